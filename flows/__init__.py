"""Prefect flows composing the stage tasks (pipeline) and the `rloo-pipeline` command line (cli)."""
