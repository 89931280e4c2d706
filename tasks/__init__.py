"""Pipeline package: filled in by the pipeline / cluster issues."""
