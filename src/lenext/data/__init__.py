"""Corpora, the tokenizer, and the token windows the model trains and is evaluated on (docs/data.md).

Every corpus is a list of documents per split. Documents are tokenized as ``[start] + tokens``, the start token
being EOS for lenext's own BPE (trained on the corpus) and, for a tokenizer from outside (``data.tokenizer``: a
tokenizer.json, or a Hugging Face tokenizer folder), its BOS if it has one, else its EOS: training concatenates
them into one stream (windows may span a document boundary, marked by the start token), while validation and test
keep each document whole, because evaluation slices windows of up to 32x L_train out of single documents. Each
held-out document also keeps the UTF-8 bytes of text its tokens span (``byte_ends``), for bits per byte.

- ``corpus``: ``Corpus``, what every corpus provides; one module per corpus: ``sotu``, ``ptb``, ``text_files``,
  ``hub`` (a new corpus is a module of its own and a config, docs/data.md "Adding a corpus");
- ``tokenizer``: lenext's BPE, or one from outside;
- ``loaders``: the training and evaluation windows and their loaders;
- ``datamodule``: ``LMDataModule``, the corpus prepared into token shards once and read memory-mapped.

The corpora and ``LMDataModule`` below are the ``_target_``s of configs/data and of every run's saved config
(``lenext.data.Sotu``): runs made before the modules were split keep loading. ``Corpus`` is what a corpus of one's
own subclasses.
"""

from lenext.data.corpus import Corpus
from lenext.data.datamodule import LMDataModule
from lenext.data.hub import HubCorpus
from lenext.data.ptb import PennTreebank
from lenext.data.sotu import Sotu
from lenext.data.text_files import TextFiles

__all__ = ["Corpus", "HubCorpus", "LMDataModule", "PennTreebank", "Sotu", "TextFiles"]
