"""Streamed pretraining data: documents from text/JSONL files or a `datasets` name, the tokenizer (loaded, or a
sentencepiece model trained on the corpus with T5's sentinels), and the stream of denoising examples."""

import glob
import itertools
import json
import os
from pathlib import Path

import torch

from fat5.cli import CommandError
from fat5.safe_files import StagedFolder

from .denoising import sentinel_token_ids

NUM_SENTINELS = 100  # T5's extra_ids


def corpus_files(patterns):
    """The files named by `patterns` (files, folders searched recursively for .txt/.jsonl/.json, or globs)."""
    files = []
    for pattern in patterns:
        path = Path(pattern)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl", ".json") and p.is_file())
        else:
            found = sorted(Path(p) for p in glob.glob(pattern)) if glob.has_magic(pattern) else [path]
        for named in found or [path]:
            if named.exists() and not named.is_file() and not named.is_dir():
                raise CommandError(f"--train_files {named} is not a regular file (a pipe, a device or a socket, such "
                                   f"as /dev/stdin): the corpus is read again for each pass over it and its size is "
                                   f"recorded for resuming, so it must be a file; save it to one first")
        if not found or not all(p.is_file() for p in found):
            raise CommandError(f"no corpus file at {pattern!r}")
        files += found
    return files


def _text(value, where, text_field):
    if not isinstance(value, str):
        raise CommandError(f"{where}: the {text_field!r} field is {type(value).__name__} {json.dumps(value)[:40]}, "
                           f"not text")
    return value


def _file_documents(path, text_field):
    """The documents of one corpus file: each line of a text file, the `text_field` of each JSONL line. Read as
    bytes and decoded line by line, so an error names the line."""
    with open(path, "rb") as file:
        for number, raw in enumerate(file, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise CommandError(f"{path}:{number} is not UTF-8 text (byte {raw[error.start]:#04x} at column "
                                   f"{error.start + 1}); convert the file to UTF-8") from None
            if path.suffix not in (".jsonl", ".json"):
                yield line  # plain text: one document a line
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise CommandError(f"{path}:{number} is not a JSON line ({error.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise CommandError(f"{path}:{number} has no {text_field!r} field (set --text_field)")
            yield _text(record[text_field], f"{path}:{number}", text_field)


class Documents:
    """A re-iterable stream of non-empty documents (strings), read lazily: from `files`, or from a streamed
    `datasets` dataset (`dataset_name`, `dataset_config`, `split`). Worker `w` of `n` DataLoader workers reads
    documents w, w + n, ..."""

    def __init__(self, files=(), text_field="text", dataset_name=None, dataset_config=None, split="train"):
        self.files = corpus_files(files) if files else []
        self.text_field = text_field
        self.dataset = None
        if dataset_name:
            import datasets  # the "pretrain" extra's (a missing one is one line: fat5/cli.py)
            try:
                self.dataset = datasets.load_dataset(dataset_name, dataset_config, split=split, streaming=True)
            except (OSError, ValueError) as error:  # offline, unknown name, config or split
                raise CommandError(f"cannot stream the dataset {dataset_name!r}: {error}") from None
        if not self.files and self.dataset is None:
            raise CommandError("no corpus: pass --train_files or --dataset_name")

    def _raw(self):
        for path in self.files:
            yield from _file_documents(path, self.text_field)
        if self.dataset is not None:
            for number, record in enumerate(self.dataset, 1):
                if self.text_field not in record:
                    raise CommandError(f"the dataset has no {self.text_field!r} column (set --text_field)")
                yield _text(record[self.text_field], f"row {number} of the dataset", self.text_field)

    def __iter__(self):
        return self.shard(0, 1)

    def shard(self, shard, num_shards):
        """Documents shard, shard + num_shards, ..."""
        for index, text in enumerate(text for text in self._raw() if text and text.strip()):
            if index % num_shards == shard:
                yield text.strip()

    def check_not_empty(self):
        if next(iter(self), None) is None:
            raise CommandError("the corpus is empty: no document with any text")


def train_sentencepiece(documents, folder, vocab_size, max_documents):
    """Trains a T5-convention unigram sentencepiece model (pad 0, eos 1, unk 2, no bos) on the first
    `max_documents` documents and returns the T5 tokenizer over it, with T5's 100 sentinels
    (`<extra_id_0>` is the last id), and the number of documents read. The tokenizer is saved in `folder`.
    `vocab_size` is an upper bound (hard_vocab_limit=False): sentencepiece keeps fewer pieces when the documents
    hold fewer (`sentencepiece_pieces` counts them), rather than failing."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    folder = Path(folder)
    failures = []
    read = [0]

    def sample():
        # sentencepiece turns an error of the iterator into a RuntimeError holding a traceback: keep ours.
        try:
            for document in itertools.islice(documents, max_documents):
                read[0] += 1
                yield document
        except CommandError as error:
            failures.append(error)

    with StagedFolder(folder) as staging:  # an interrupted training leaves no half-written tokenizer
        try:
            # No byte_fallback: transformers' fast T5 tokenizer does not implement it (as T5, rare characters ->
            # <unk>).
            spm.SentencePieceTrainer.train(
                sentence_iterator=sample(), model_prefix=str(staging.path / "spiece"), vocab_size=vocab_size,
                model_type="unigram", character_coverage=0.9995, split_digits=True, pad_id=0,
                eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
                hard_vocab_limit=False, minloglevel=2, num_threads=os.cpu_count() or 1)
        except RuntimeError as error:
            raise failures[0] if failures else CommandError(
                f"sentencepiece could not train a tokenizer: {str(error).splitlines()[-1]}") from None
        if failures:
            raise failures[0]
        (staging.path / "spiece.vocab").unlink(missing_ok=True)
        # add_prefix_space: transformers 4.57's converter otherwise drops the "▁" before the first word.
        (staging.path / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "T5Tokenizer", "extra_ids": NUM_SENTINELS, "add_prefix_space": True,
             "legacy": True}))
        AutoTokenizer.from_pretrained(staging.path).save_pretrained(staging.path)
        staging.commit()
    return AutoTokenizer.from_pretrained(folder), read[0]


def sentencepiece_pieces(folder):
    """The number of pieces of the sentencepiece model in `folder` (its special pieces included)."""
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(Path(folder) / "spiece.model")).get_piece_size()


def add_missing_tokens(tokenizer, prefixes, rows, may_grow):
    """Adds T5's sentinels (when the tokenizer has none) and the mixture's prefix tokens (when absent) as special
    tokens. `rows` is the model's embedding size (None: a new model, sized afterwards). Sentinels that do not fit
    in the existing rows need `may_grow` (they would be untrained rows of a trained model); prefixes always may
    grow it. Returns the sentinel ids."""
    if not sentinel_token_ids(tokenizer):
        if rows is not None and len(tokenizer) + NUM_SENTINELS > rows and not may_grow:
            raise CommandError(
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
    """Endless stream of {"input_ids", "labels"} examples: documents are tokenised on the fly (no EOS; the
    denoiser adds it) and cut and corrupted by `mixture` (a `DenoisingMixture`), pass after pass over the corpus.

    The stream is a deterministic function of the seed: pass p over the documents of shard s draws its examples
    with the seed (seed, p, s). Being endless, it is one epoch to Trainer, which resumes it exactly by skipping
    the batches already trained on, whatever the number of passes behind (a finite stream would be restarted by
    Trainer at the wrong pass). With DataLoader workers, each reads its own share of the documents; a worker
    whose share makes no example stops."""

    def __init__(self, documents, tokenizer, mixture, seed=0):
        self.documents = documents
        self.tokenizer = tokenizer
        self.mixture = mixture
        self.seed = seed
        # Examples of each shard's stream already trained on, skipped when a run resumes (see PretrainTrainer).
        self.skip = None

    def pass_examples(self, corpus_pass, shard=0, num_shards=1):
        """The examples of one pass over the documents of `shard` (of `num_shards`)."""
        texts = self.documents.shard(shard, num_shards)
        token_lists = (self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts)
        return self.mixture.examples(token_lists, seed=(self.seed, corpus_pass, shard))

    def first_example(self):
        """The stream's first example, or None when the corpus is too short to make one."""
        return next(self.pass_examples(0), None)

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        shard, num_shards = (worker.id, worker.num_workers) if worker else (0, 1)
        if self.skip is not None and len(self.skip) != num_shards:
            raise ValueError(f"the stream was read by {len(self.skip)} shards, and now by {num_shards}")
        return itertools.islice(self._shard_stream(shard, num_shards), self.skip[shard] if self.skip else 0, None)

    def _shard_stream(self, shard, num_shards):
        for corpus_pass in itertools.count():
            made = False
            for example in self.pass_examples(corpus_pass, shard, num_shards):
                made = True
                yield example
            if not made:
                return
