"""The connector's worker side: saves from the paged KV cache and loads back into it."""
