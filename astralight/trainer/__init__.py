"""What runs inside a trainer process (``astralight fit``) besides the policy LightningModules
(:mod:`astralight.policy`) and the RL math (:mod:`astralight.rl`): the LightningCLI entry point
(:mod:`~astralight.trainer.trainer_cli`), the graceful stop on SIGTERM
(:mod:`~astralight.trainer.graceful_stop`), the FSDP2 strategy and its checkpoint I/O, LoRA, the
Hugging Face model loading, the tiny models the CPU recipes build, and ``astralight export``.

Nothing is imported here: a process importing one module does not pay for the others.
"""
