"""Code that drives distributed engines (Ray Train, DeepSpeed). The only place in
`rlhf_core` besides `rollout/` allowed to import them (tests/test_layering.py)."""
