"""The fsdptrace command line."""
