"""The data layer: tokenizers, corpus formats, the prepared corpus (`bdh-train prepare`),
token sources (builtin corpora, text, .bin files, prepared directories, generated data) and
deterministic, resumable loaders that produce SequenceBatch; `DataConfig` is the `[data]`
section."""

from bdh_train.data.config import GENERATED_SOURCES, DataConfig
from bdh_train.data.eval_windows import eval_batches
from bdh_train.data.formats import iter_documents
from bdh_train.data.loaders import (
    RandomWindowLoader,
    StreamingCorpusLoader,
    StreamingDocumentLoader,
    TokenSource,
)
from bdh_train.data.mqar import MqarConfig
from bdh_train.data.nca import NcaConfig
from bdh_train.data.prepared import load_prepared, prepare_corpus
from bdh_train.data.sources import (
    BUILTIN_CORPORA,
    TokenGenerator,
    builtin_corpus,
    load_splits,
    load_tokens,
)
from bdh_train.data.tokenizer import ByteTokenizer
from bdh_train.data.tokens import (
    TOKEN_DTYPES,
    TokenData,
    header_path,
    read_header,
    write_token_file,
)

__all__ = [
    "BUILTIN_CORPORA",
    "GENERATED_SOURCES",
    "TOKEN_DTYPES",
    "ByteTokenizer",
    "DataConfig",
    "MqarConfig",
    "NcaConfig",
    "RandomWindowLoader",
    "StreamingCorpusLoader",
    "StreamingDocumentLoader",
    "TokenData",
    "TokenGenerator",
    "TokenSource",
    "builtin_corpus",
    "eval_batches",
    "header_path",
    "iter_documents",
    "load_prepared",
    "load_splits",
    "load_tokens",
    "prepare_corpus",
    "read_header",
    "write_token_file",
]
