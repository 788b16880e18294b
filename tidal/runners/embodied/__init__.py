"""The embodied half's commands: ``train`` (a runner per ``algorithm.name``, ``select``:
``EmbodiedRunner`` for PPO, ``OffPolicyRunner`` for SAC, both built from ``groups`` and
``pacer``), ``sft`` (behaviour cloning) and ``eval`` (a saved policy on fresh episodes)."""
