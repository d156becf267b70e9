"""Optimizers in Megatron-Core's contract (``MegatronOptimizer`` / ``ChainedOptimizer``).

- ``controlled.py``          ``ControlledOptimizer``: Megatron's ``ChainedOptimizer`` with one
                             global gradient norm and one clip over every part (dense Megatron
                             optimizers, and a low-rank part such as LoGRA's), and a step that
                             can be proposed, previewed and committed (the KL controller's
                             protocol)
- ``factory.py``             ``get_dense_optimizer(config, model_chunks)``: Megatron's own
                             optimizer (``get_megatron_optimizer``) inside that chain
- ``dense_memory.py``        what each dense optimizer row holds on a rank (``DENSE_ROWS``),
                             read by the memory planner
- ``megatron_internals.py``  the private members of megatron-core's optimizers this package
                             reads, in one place, with the version they were read from
"""
