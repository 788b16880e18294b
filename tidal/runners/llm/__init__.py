"""The language half's commands: ``train`` (the asynchronous RL runner), ``sft`` (supervised warm
start) and ``eval`` (held-out records through an inference server); ``common`` is what they build
alike from a config."""
