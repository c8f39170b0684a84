"""The semantic cache: tenant-safe scope keys, exact and verified semantic lookup, SQLite + faiss storage."""
