"""The connector's scheduler side: what the store holds, lookups, leases, the self-check."""
