"""Hub-ready MARS checkpoints (placeholder being written in parallel; see issue 4)."""


def write_mars_extras(save_directory, model=None, tokenizer=None, training_args=None) -> None:
    """Write the MARS-specific files of a checkpoint folder (generation defaults, custom_generate/, model card).

    Called by MARSTrainer for every checkpoint it saves. Placeholder until hub.py lands.
    """
    return None
