"""The embodied half's commands: ``train`` (``EmbodiedRunner``), ``sft`` (behaviour cloning) and
``eval`` (a saved policy on fresh episodes)."""
