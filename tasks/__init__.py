"""Prefect tasks: one per pipeline stage, each a thin wrapper over a plain function in
`infra.stages`."""
