"""evaluate(): the mean loss over counted targets, and bits per byte only for byte-level text."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import tiny_model

from bdh_train.data.sources import TokenData
from bdh_train.errors import DataError
from bdh_train.train.evaluate import evaluate
from bdh_train.train.step import LanguageTrainModel


@pytest.mark.parametrize("byte_level", [True, False], ids=["text-bytes", "token-ids"])
def test_bits_per_byte_only_for_byte_level_text(byte_level: bool) -> None:
    """The same ids as the bytes of text and as token ids from a .bin file: the same loss, and
    bits per byte (loss / ln 2) only where a token is a byte."""
    ids = (np.arange(200) * 7) % 32
    data = TokenData(ids, 32, "test", byte_level=byte_level)
    step = LanguageTrainModel(tiny_model(vocab_size=32))
    result = evaluate(step, data, block_size=8, batch_size=4, max_batches=None)
    windows = (len(ids) - 1) // 8
    assert result.tokens == windows * 8
    if byte_level:
        assert result.bits_per_byte == pytest.approx(result.val_loss / math.log(2), rel=1e-12)
        assert result.row() == {"val_loss": result.val_loss, "bits_per_byte": result.bits_per_byte}
    else:
        assert result.bits_per_byte is None and result.row() == {"val_loss": result.val_loss}


def test_evaluate_over_no_batches_is_refused() -> None:
    data = TokenData(np.arange(50) % 32, 32, "test", byte_level=True)
    with pytest.raises(DataError):
        evaluate(LanguageTrainModel(tiny_model(vocab_size=32)), data, 8, 4, max_batches=0)
