"""Tensor math on Megatron's sharded outputs, used by training/, the KL controller and rl/."""
