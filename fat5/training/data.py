"""Streamed pretraining data: documents from text/JSONL files or a `datasets` name, the tokenizer (loaded, or a
sentencepiece model trained on the corpus with T5's sentinels), and the stream of denoising examples."""

import glob
import json
import os
from pathlib import Path

import torch

from .denoising import sentinel_token_ids

NUM_SENTINELS = 100  # T5's extra_ids


class PretrainError(Exception):
    """Bad input to the pretraining command: reported as one line, with a non-zero exit."""


def corpus_files(patterns):
    """The files named by `patterns` (files, folders searched recursively for .txt/.jsonl/.json, or globs)."""
    files = []
    for pattern in patterns:
        path = Path(pattern)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl", ".json") and p.is_file())
        else:
            found = sorted(Path(p) for p in glob.glob(pattern)) if glob.has_magic(pattern) else [path]
        if not found or not all(p.is_file() for p in found):
            raise PretrainError(f"no corpus file at {pattern!r}")
        files += found
    return files


def _file_documents(path, text_field):
    with open(path, encoding="utf-8") as file:
        if path.suffix not in (".jsonl", ".json"):
            yield from file  # plain text: one document a line
            return
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise PretrainError(f"{path}:{number} is not a JSON line ({error.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise PretrainError(f"{path}:{number} has no {text_field!r} field (set --text_field)")
            yield record[text_field]


class Documents:
    """A re-iterable stream of non-empty documents (strings), read lazily: from `files`, or from a streamed
    `datasets` dataset (`dataset_name`, `dataset_config`, `split`). Worker `w` of `n` DataLoader workers reads
    documents w, w + n, ..."""

    def __init__(self, files=(), text_field="text", dataset_name=None, dataset_config=None, split="train"):
        self.files = corpus_files(files) if files else []
        self.text_field = text_field
        self.dataset = None
        if dataset_name:
            try:
                import datasets
            except ImportError:
                raise PretrainError("--dataset_name needs the datasets library: pip install 'fat5[pretrain]'") from None
            try:
                self.dataset = datasets.load_dataset(dataset_name, dataset_config, split=split, streaming=True)
            except (OSError, ValueError) as error:  # offline, unknown name, config or split
                raise PretrainError(f"cannot stream the dataset {dataset_name!r}: {error}") from None
        if not self.files and self.dataset is None:
            raise PretrainError("no corpus: pass --train_files or --dataset_name")

    def _raw(self):
        for path in self.files:
            yield from _file_documents(path, self.text_field)
        if self.dataset is not None:
            for record in self.dataset:
                if self.text_field not in record:
                    raise PretrainError(f"the dataset has no {self.text_field!r} column (set --text_field)")
                yield record[self.text_field]

    def __iter__(self):
        return self.shard(0, 1)

    def shard(self, shard, num_shards):
        """Documents shard, shard + num_shards, ..."""
        for index, text in enumerate(text for text in self._raw() if text and text.strip()):
            if index % num_shards == shard:
                yield text.strip()

    def check_not_empty(self):
        if next(iter(self), None) is None:
            raise PretrainError("the corpus is empty: no document with any text")


def train_sentencepiece(documents, folder, vocab_size, max_documents):
    """Trains a T5-convention unigram sentencepiece model (pad 0, eos 1, unk 2, no bos) on the first
    `max_documents` documents and returns the T5 tokenizer over it, with T5's 100 sentinels
    (`<extra_id_0>` is the last id). The tokenizer is saved in `folder`."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sample = (text for _, text in zip(range(max_documents), documents))
    try:
        # No byte_fallback: transformers' fast T5 tokenizer does not implement it (as T5, rare characters -> <unk>).
        spm.SentencePieceTrainer.train(
            sentence_iterator=sample, model_prefix=str(folder / "spiece"), vocab_size=vocab_size,
            model_type="unigram", character_coverage=0.9995, split_digits=True, pad_id=0,
            eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
            hard_vocab_limit=False, minloglevel=2, num_threads=os.cpu_count() or 1)
    except RuntimeError as error:
        raise PretrainError(f"sentencepiece could not train a tokenizer: {str(error).splitlines()[-1]}") from None
    (folder / "spiece.vocab").unlink(missing_ok=True)
    # add_prefix_space: transformers 4.57's converter otherwise drops the "▁" before the first word.
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "T5Tokenizer", "extra_ids": NUM_SENTINELS, "add_prefix_space": True, "legacy": True}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer


def add_missing_tokens(tokenizer, prefixes, rows, may_grow):
    """Adds T5's sentinels (when the tokenizer has none) and the mixture's prefix tokens (when absent) as special
    tokens. `rows` is the model's embedding size (None: a new model, sized afterwards). Sentinels that do not fit
    in the existing rows need `may_grow` (they would be untrained rows of a trained model); prefixes always may
    grow it. Returns the sentinel ids."""
    if not sentinel_token_ids(tokenizer):
        if rows is not None and len(tokenizer) + NUM_SENTINELS > rows and not may_grow:
            raise PretrainError(
                f"the tokenizer has no sentinel tokens (<extra_id_0>, ...) and the model's {rows} embedding rows "
                f"have no room for {NUM_SENTINELS} more after its {len(tokenizer)} tokens; pass "
                f"--resize_embeddings to grow them, or use a tokenizer with sentinels")
        # Reverse order, so that <extra_id_0> gets the highest id, as in T5.
        tokenizer.add_tokens([f"<extra_id_{i}>" for i in reversed(range(NUM_SENTINELS))], special_tokens=True)
    absent = [prefix for prefix in prefixes if prefix not in tokenizer.get_vocab()]
    if absent:
        tokenizer.add_tokens(absent, special_tokens=True)
    return sentinel_token_ids(tokenizer)


class DenoisingDataset(torch.utils.data.IterableDataset):
    """Endless-per-epoch stream of {"input_ids", "labels"} examples: documents are tokenised on the fly (no EOS;
    the denoiser adds it) and cut and corrupted by `mixture` (a `DenoisingMixture`). Deterministic for a seed and
    epoch; with DataLoader workers, each reads its own share of the documents."""

    def __init__(self, documents, tokenizer, mixture, seed=0):
        self.documents = documents
        self.tokenizer = tokenizer
        self.mixture = mixture
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        shard, num_shards = (worker.id, worker.num_workers) if worker else (0, 1)
        texts = self.documents.shard(shard, num_shards)
        token_lists = (self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts)
        yield from self.mixture.examples(token_lists, seed=(self.seed, self.epoch, shard))
