"""`[data]`: where tokens come from, the validation split, and the options of generated data.

The names a source may take live here and in `sources`: `builtin:<name>` for the corpora in
`sources.BUILTIN_CORPORA`, a name in `GENERATED_SOURCES`, or a filesystem path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from bdh_train import checks
from bdh_train.data.nca import NcaConfig, nca_source
from bdh_train.data.sources import (
    BUILTIN_CORPORA,
    BUILTIN_PREFIX,
    TokenData,
    TokenGenerator,
    load_splits,
    load_tokens,
)
from bdh_train.errors import ConfigError
from bdh_train.utils import suggest

GENERATED_SOURCES: dict[str, Callable[[DataConfig], TokenGenerator]] = {
    "nca": lambda cfg: lambda vocab_size: nca_source(cfg.nca, vocab_size),
}
"""Source names served by a generator built from the data config, instead of a file."""


@dataclass
class DataConfig:
    """Where tokens come from. The vocabulary size is the model's (``model.vocab_size``)."""

    source: str = "builtin:pydoc"
    """``builtin:<name>``, a generated source (``nca``), or a path (text file or directory, or
    a ``.bin`` token file with a ``.json`` header)."""
    val_fraction: float = 0.1
    """The share of the tokens held out for validation, taken from the end (0 = none)."""
    nca: NcaConfig = field(default_factory=NcaConfig)

    def validate(self, prefix: str = "data") -> DataConfig:
        checks.string(f"{prefix}.source", self.source)
        if not self.source:
            raise ConfigError(
                f"{prefix}.source must be 'builtin:<name>', "
                f"{', '.join(map(repr, GENERATED_SOURCES))} or a path, got ''"
            )
        if self.source.startswith(BUILTIN_PREFIX):
            name = self.source[len(BUILTIN_PREFIX) :]
            if name not in BUILTIN_CORPORA:
                raise ConfigError(
                    f"{prefix}.source names an unknown builtin corpus {name!r}; known: "
                    f"{', '.join(BUILTIN_PREFIX + b for b in BUILTIN_CORPORA)}"
                    f"{suggest(name, BUILTIN_CORPORA)}"
                )
        checks.number(f"{prefix}.val_fraction", self.val_fraction, low=0.0, high=1.0)
        self.nca.validate(f"{prefix}.nca")
        return self

    @property
    def is_generated(self) -> bool:
        return self.source in GENERATED_SOURCES

    def generators(self) -> dict[str, TokenGenerator]:
        """The token generators `load_tokens` needs for this config's generated sources."""
        return {name: make(self) for name, make in GENERATED_SOURCES.items()}

    def load_splits(self, vocab_size: int, block_size: int) -> tuple[TokenData, TokenData | None]:
        """(train, validation) token data, each long enough for `block_size`."""
        return load_splits(
            self.source, vocab_size, block_size, self.val_fraction, self.generators()
        )

    def load_source(self, source: str, vocab_size: int) -> TokenData:
        """Any other source (e.g. held-out eval data), resolved with this config's generators."""
        return load_tokens(source, vocab_size, self.generators())
