"""Code that runs inside a vLLM server (its own environment: torch + vllm only, nothing from
`rloo`).

`rloo_vllm.engine` registers the "gloo" weight-transfer backend, the CPU counterpart of vLLM's NCCL
one, so the trainer pushes weights through the same routes (/init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update) on a machine without GPUs.
`rloo_vllm.wire` is the part both sides share.
"""
