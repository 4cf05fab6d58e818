"""FSDP implementations the recorder can read from."""
