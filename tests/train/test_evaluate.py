"""evaluate(): the mean loss over counted targets, and bits per UTF-8 byte where the tokens are
text of a tokenizer (the byte tokenizer's value unchanged, a BPE's by hand)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import bpe_corpus, tiny_model

from bdh_train.batch import IGNORE_INDEX
from bdh_train.data import eval_batches
from bdh_train.data.tokenizer import ByteTokenizer
from bdh_train.data.tokens import TokenData
from bdh_train.errors import DataError
from bdh_train.model.config import LanguageHeadConfig
from bdh_train.train.evaluate import counted_target_bytes, evaluate
from bdh_train.train.step import LanguageTrainModel


@pytest.mark.parametrize("text", [True, False], ids=["text-bytes", "token-ids"])
def test_bits_per_byte_of_byte_text_is_the_loss_over_ln_2(text: bool) -> None:
    """The same ids as the bytes of text and as token ids of no tokenizer: the same loss, and
    bits per byte only for the text, exactly the mean loss / ln 2 (every target is a byte)."""
    ids = (np.arange(200) * 7) % 32
    data = TokenData(ids, 32, "test", byte_level=text)
    lengths = ByteTokenizer().token_byte_lengths() if text else None
    for seed in range(6 if text else 1):  # a reordered formula differs in the last bit of some
        step = LanguageTrainModel(tiny_model(vocab_size=32, seed=seed))
        result = evaluate(
            step, data, block_size=8, batch_size=4, max_batches=None, byte_lengths=lengths
        )
        windows = (len(ids) - 1) // 8
        assert result.tokens == windows * 8
        if text:
            assert result.bits_per_byte == result.val_loss / math.log(2)  # exact: the old formula
            row = {"val_loss": result.val_loss, "bits_per_byte": result.bits_per_byte}
            assert result.row() == row
        else:
            assert result.bits_per_byte is None and result.row() == {"val_loss": result.val_loss}


def test_bits_per_byte_of_a_bpe_model_by_hand(tmp_path) -> None:
    """Nats summed over the targets / ln 2 / the UTF-8 bytes those targets decode to, against
    a float64 forward pass and each target decoded on its own."""
    tok, _, _ = bpe_corpus(tmp_path)
    ids = np.array(tok.encode("ROMEO 7: the quick brown fox — ünïcödé 日本 jumps over 49 lazy"))
    data = TokenData(ids, tok.vocab_size, "bpe text")
    model = tiny_model(torch.float64, vocab_size=tok.vocab_size).eval()
    result = evaluate(
        LanguageTrainModel(model), data, 5, 2, None, byte_lengths=tok.token_byte_lengths()
    )
    nats, text_bytes, counted = 0.0, 0, 0
    for batch in eval_batches(data, 5, 2):
        with torch.no_grad():
            logits, _ = model(batch.inputs)
        nats += F.cross_entropy(
            logits.reshape(-1, tok.vocab_size), batch.targets.reshape(-1), reduction="sum"
        ).item()
        text_bytes += sum(len(tok.decode_bytes([t])) for t in batch.targets.reshape(-1).tolist())
        counted += batch.targets.numel()
    assert text_bytes > counted  # merges: a token is more than one byte here
    assert result.tokens == counted
    # the step returns its mean loss in float32: 1e-6 against the float64 sum
    assert result.val_loss == pytest.approx(nats / counted, rel=1e-6)
    assert result.bits_per_byte == pytest.approx(nats / math.log(2) / text_bytes, rel=1e-6)
    # the byte count is exact: the same sums give the same bits to float64 rounding
    own_nats = result.val_loss * result.tokens
    assert result.bits_per_byte == pytest.approx(own_nats / math.log(2) / text_bytes, rel=1e-12)


def test_bytes_are_counted_over_the_targets_the_head_counts(tmp_path) -> None:
    lengths = torch.tensor([1, 2, 3, 4])
    targets = torch.tensor([[0, 3, IGNORE_INDEX], [2, IGNORE_INDEX, 1]])
    assert counted_target_bytes(targets, lengths, LanguageHeadConfig()) == 1 + 4 + 3 + 2


def test_evaluate_over_no_batches_is_refused() -> None:
    data = TokenData(np.arange(50) % 32, 32, "test", byte_level=True)
    with pytest.raises(DataError):
        evaluate(LanguageTrainModel(tiny_model(vocab_size=32)), data, 8, 4, max_batches=0)


def test_bits_per_byte_split_over_ranks_equals_one_process() -> None:
    """Data parallel: each rank evaluates every other batch and adds its sums (loss, targets,
    bytes) to the other's. A hand-made all-reduce stands in for the process group: it adds
    the other rank's own sums, recorded first. Every rank gets one process's loss and bits
    per byte, and those are the hand formula's (ids of 1 to 4 bytes, so bytes != targets)."""
    ids = (np.arange(5 * 2 * 8 + 1) * 7) % 32
    data = TokenData(ids, 32, "test")
    lengths = np.random.default_rng(0).integers(1, 5, size=32)
    step = LanguageTrainModel(tiny_model(vocab_size=32, seed=1))

    def run(rank: int, world: int, add=None):
        return evaluate(step, data, 8, 2, None, byte_lengths=lengths, part=(rank, world),
                        add_across_ranks=add)  # fmt: skip

    whole = run(0, 1)
    hand_bytes = int(lengths[ids[1 : 5 * 2 * 8 + 1]].sum())  # every target of the 5 batches
    hand = whole.val_loss * whole.tokens / math.log(2) / hand_bytes
    assert whole.bits_per_byte == pytest.approx(hand, rel=1e-12)
    own: dict[int, list[float]] = {}
    for rank in (0, 1):
        run(rank, 2, lambda sums, rank=rank: own.setdefault(rank, list(sums)))
    for rank in (0, 1):

        def add(sums, rank=rank):
            return [a + b for a, b in zip(sums, own[1 - rank], strict=True)]

        split = run(rank, 2, add)
        assert split.tokens == whole.tokens
        assert split.val_loss == pytest.approx(whole.val_loss, rel=1e-12)
        assert split.bits_per_byte == pytest.approx(whole.bits_per_byte, rel=1e-12)


class _TargetMean:
    """An EvalLoss whose loss of a target is the target id: the mean loss is the mean id."""

    def eval_loss(self, batch):
        return float(batch.targets.sum()), float(batch.targets.numel())


def test_a_partial_evaluation_samples_the_whole_split() -> None:
    """A split of 40 windows of 4 tokens whose first half targets id 0 and second half id 1:
    its first 2 batches of 4 windows (what an evaluation read before) mean 0.0; the 8 windows
    read now, one from each stratum of 5 windows, are 4 from each half, so exactly 0.5, the
    same windows on every call; enough batches for the whole split read every window in
    order."""
    ids = np.zeros(40 * 4 + 1, dtype=np.int64)
    ids[20 * 4 + 1 :] = 1  # the targets of windows 20..39
    data = TokenData(ids, 2, "halves")
    assert ids[1 : 8 * 4 + 1].mean() == 0.0  # the first 8 windows' targets
    sampled = evaluate(_TargetMean(), data, 4, 4, max_batches=2)
    assert sampled.tokens == 8 * 4 and sampled.val_loss == 0.5

    def windows(max_batches: int) -> list[int]:
        batches = eval_batches(np.arange(161), 4, 4, max_batches)
        return [int(start) // 4 for b in batches for start in b.inputs[:, 0]]

    assert [w // 5 for w in windows(2)] == list(range(8))  # one window in each stratum of 5
    assert windows(2) == windows(2)
    assert windows(10) == list(range(40))
    every = evaluate(_TargetMean(), data, 4, 4, max_batches=None)
    assert every.tokens == 40 * 4 and every.val_loss == 0.5
