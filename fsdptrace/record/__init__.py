"""The in-process recorder. Imports torch and pyarrow only: never pandas or click."""
