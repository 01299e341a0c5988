"""The config of a lenext model exported with its own code (written by lenext-export; no lenext import needed)."""

from transformers import PretrainedConfig


class LenextConfig(PretrainedConfig):
    """``lenext``: the run's model, PE and attention nodes as lenext resolved them, its training length and the
    span of positions training reached; ``position_limit``: the positions a learned table serves (null: any)."""

    model_type = "lenext"

    def __init__(self, lenext: dict | None = None, position_limit: int | None = None, **kwargs):
        self.lenext = lenext or {}
        self.position_limit = position_limit
        super().__init__(**kwargs)
