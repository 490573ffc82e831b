"""The connector's scheduler side: what the store holds, lookups, leases, the start-up self-check."""
