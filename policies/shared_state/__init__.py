"""State shared by replicas: the Redis/Valkey client and its multiplexed connection, the budget stores and their Lua scripts, and what a replica admits while the store is out."""
