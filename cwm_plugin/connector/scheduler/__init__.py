"""The connector's scheduler side: what the store holds, lookups, leases, saves and
context records, the self-check."""
