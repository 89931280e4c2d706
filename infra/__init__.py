"""What talks to a cluster and to the tracking server: the run config (runconfig), the stages as
plain functions (stages), local and SLURM launch (jobs, launch, slurm, cluster/), MLflow
(tracking)."""
