"""Train the tiny demo T5 bundled in fat5/convert/demo_t5 (the default input of `python -m convert.flan_to_fat5`).

    python scripts/train_demo_t5.py [--out fat5/convert/demo_t5] [--steps 5000] [--seed 0] [--threads 1]

(with the fat5 package installed, e.g. `pip install -e .`, since it reads the demo prompts from fat5/convert/demo.py,
and transformers 4.x: transformers 5 always ties T5's LM head to the embeddings when it builds one from a config,
so it cannot make the untied FLAN-T5 layout; both load the result)

A genuine Hugging Face T5ForConditionalGeneration in the FLAN-T5 / T5 v1.1 layout (gated-GELU feed-forward,
untied LM head, relative attention buckets) with its own sentencepiece vocabulary, trained from scratch on CPU
on three synthetic text-to-text tasks with FLAN-style prefixes:

    reverse: the cat sat on the mat   ->  mat the on sat cat the
    spell out: 347                    ->  three hundred forty seven
    sort: pear apple fig              ->  apple fig pear

Everything is deterministic for a given --seed: the data, the tokenizer, the initialisation and the batches.
The demo prompts of fat5/convert/demo.py are held out of training with about 10% of all prompts, which are used to
measure exact-match accuracy.
"""

import argparse
import json
import math
import random
import tempfile
import time
import zlib
from pathlib import Path

import sentencepiece as spm
import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GenerationConfig,
    T5Config,
    T5ForConditionalGeneration,
    T5TokenizerFast,
)

from fat5.convert.demo import DEMO_CHECKPOINT, DEMO_PROMPTS

WORDS = ("the a cat dog bird fish fox cow hen owl sat ran saw ate sang slept on in under by near mat box "
         "tree house road hill pond red big small old happy little blue green one two").split()
FRUITS = ("apple apricot banana cherry date fig grape kiwi lemon lime mango melon olive orange papaya peach "
          "pear plum").split()
ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
       "seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
DEMO_HELD_OUT = {prompt for prompt, _ in DEMO_PROMPTS}
SPM_VOCAB = 128
EXTRA_IDS = 8  # T5-style sentinels <extra_id_0..7> at the top of the vocabulary
MAX_NEW_TOKENS = 32
BATCH_SIZE = 64


def spell(n):
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else " " + ONES[n % 10])
    return ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + spell(n % 100))


TASKS = {
    "reverse": lambda rng: reverse(rng.choices(WORDS, k=rng.randint(3, 7))),
    "spell out": lambda rng: (f"spell out: {(n := rng.randrange(1000))}", spell(n)),
    "sort": lambda rng: sort(rng.sample(FRUITS, rng.randint(2, 6))),
}


def reverse(words):
    return "reverse: " + " ".join(words), " ".join(reversed(words))


def sort(fruits):
    return "sort: " + " ".join(fruits), " ".join(sorted(fruits))


def held_out(prompt):
    """About 10% of all possible prompts, and the demo's, are never trained on, only evaluated."""
    return zlib.crc32(prompt.encode()) % 10 == 0 or prompt in DEMO_HELD_OUT


def sample(rng, task, evaluation):
    while True:
        prompt, target = TASKS[task](rng)
        if held_out(prompt) == evaluation:
            return prompt, target


def train_batch(rng, size):
    return [sample(rng, rng.choice(list(TASKS)), evaluation=False) for _ in range(size)]


def eval_set(rng, task, size):
    """Up to `size` distinct held-out prompts of one task (spell-out has only about 100)."""
    examples = {}
    for _ in range(50 * size):
        prompt, target = sample(rng, task, evaluation=True)
        examples[prompt] = target
        if len(examples) == size:
            break
    return list(examples.items())


def train_tokenizer(seed, folder):
    """A T5-convention unigram sentencepiece model (pad 0, eos 1, unk 2, no bos; the default NFKC normalisation,
    which the fast tokenizer converter expects) and its T5TokenizerFast. Sentinels follow T5: <extra_id_0> is the
    last id. add_prefix_space: transformers 4.57's converter otherwise drops the "▁" before the first word."""
    corpus = [text for example in train_batch(random.Random(seed), 20000) for text in example]
    prefix = Path(folder) / "spiece"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_prefix=str(prefix), vocab_size=SPM_VOCAB, model_type="unigram",
        character_coverage=1.0, split_digits=True, pad_id=0, eos_id=1,
        unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>", num_threads=1, minloglevel=2)
    return T5TokenizerFast(vocab_file=f"{prefix}.model", extra_ids=EXTRA_IDS, add_prefix_space=True)


def build_model(vocab_size):
    config = T5Config(
        vocab_size=vocab_size, d_model=128, d_kv=32, d_ff=320, num_layers=3, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1)
    model = T5ForConditionalGeneration(config)
    if model.lm_head.weight is model.shared.weight:
        raise SystemExit("this transformers ties T5's LM head to its embeddings whatever the config says; "
                         "run with transformers 4.x to build an untied (FLAN-T5 style) model")
    return model


def encode(tokenizer, batch):
    prompts, targets = zip(*batch)
    inputs = tokenizer(list(prompts), padding=True, return_tensors="pt")
    labels = tokenizer(list(targets), padding=True, return_tensors="pt").input_ids
    labels[labels == tokenizer.pad_token_id] = -100
    return inputs, labels


@torch.no_grad()
def exact_match(model, tokenizer, examples, batch_size=256):
    model.eval()
    correct = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        inputs = tokenizer([prompt for prompt, _ in chunk], padding=True, return_tensors="pt")
        output = model.generate(**inputs, do_sample=False, num_beams=1, max_new_tokens=MAX_NEW_TOKENS)
        answers = tokenizer.batch_decode(output, skip_special_tokens=True)
        correct += sum(answer == target for answer, (_, target) in zip(answers, chunk))
    model.train()
    return correct / len(examples)


def train(model, tokenizer, steps, seed, monitor, batch_size=BATCH_SIZE, lr=1e-3, warmup=200):
    rng = random.Random(seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warmup, 0.5 * (1 + math.cos(math.pi * step / steps))))
    model.train()
    start = time.time()
    for step in range(1, steps + 1):
        inputs, labels = encode(tokenizer, train_batch(rng, batch_size))
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 250 == 0 or step == steps:
            print(f"step {step:5d}  loss {loss.item():.4f}  lr {schedule.get_last_lr()[0]:.2e}  "
                  f"{time.time() - start:.0f}s", flush=True)
        if step % 1000 == 0:
            scores = {task: round(exact_match(model, tokenizer, examples), 3) for task, examples in monitor.items()}
            print(f"step {step:5d}  exact match on 100 held-out prompts per task: {scores}", flush=True)
    return time.time() - start


def write_card(out, model, vocab_size, steps, seconds, accuracy, evaluation):
    params = sum(p.numel() for p in model.parameters())
    rows = "\n".join(f"| `{prompt}` | `{target}` |" for prompt, target in DEMO_PROMPTS)
    scores = "\n".join(f"| {task} | {len(evaluation[task])} | {score:.1%} |" for task, score in accuracy.items())
    (out / "README.md").write_text(f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text2text-generation
tags:
- t5
- text2text-generation
- demo
---

# Tiny demo T5

A {params / 1e6:.2f}M-parameter `T5ForConditionalGeneration` (T5 v1.1 / FLAN-T5 layout: gated-GELU feed-forward,
untied LM head, relative position buckets; {model.config.num_layers} encoder and {model.config.num_decoder_layers}
decoder layers, d_model {model.config.d_model}) with its own sentencepiece vocabulary ({vocab_size} tokens,
{EXTRA_IDS} of them T5-style `<extra_id_N>` sentinels). It is the default input of FAT5's converter demo
(`python -m convert.flan_to_fat5`) and is only meant to show that a converted model still gives the right answers.

It was trained from scratch on CPU by `python scripts/train_demo_t5.py` ({steps} AdamW steps of {BATCH_SIZE}
examples, {seconds / 60:.1f} minutes on {torch.get_num_threads()} CPU thread(s)) on three synthetic tasks with
FLAN-style prefixes:

| prompt | output |
|---|---|
{rows}

Exact-match accuracy with greedy decoding on held-out prompts, which were never trained on (about 10% of all
possible prompts, chosen by a hash of the prompt, plus the examples above; for spell-out that is every held-out
number):

| task | held-out prompts | exact match |
|---|---|---|
{scores}
""")


def check_saved(out, examples):
    """Reload the folder the way users do and check the demo prompts."""
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    for prompt, target in examples:
        ids = model.generate(**tokenizer(prompt, return_tensors="pt"), do_sample=False)
        answer = tokenizer.decode(ids[0], skip_special_tokens=True)
        print(f"  {prompt!r} -> {answer!r}" + ("" if answer == target else f"   (expected {target!r})"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEMO_CHECKPOINT)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: a model this small gains little from more, and extra "
                             "threads slow it down badly on a busy machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    with tempfile.TemporaryDirectory() as folder:
        tokenizer = train_tokenizer(args.seed, folder)
        tokenizer.save_pretrained(args.out)  # while spiece.model still exists, so that it is saved too
    model = build_model(len(tokenizer))
    print(f"vocab {len(tokenizer)}, {sum(p.numel() for p in model.parameters()):,} parameters")

    eval_rng = random.Random(args.seed + 2)
    evaluation = {task: eval_set(eval_rng, task, 300) for task in TASKS}
    monitor = {task: examples[:100] for task, examples in evaluation.items()}
    seconds = train(model, tokenizer, args.steps, args.seed, monitor)

    accuracy = {task: exact_match(model, tokenizer, examples) for task, examples in evaluation.items()}
    print("held-out exact match:", json.dumps(accuracy))

    model.generation_config = GenerationConfig(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                               max_new_tokens=MAX_NEW_TOKENS)
    model.save_pretrained(args.out, safe_serialization=True)
    write_card(args.out, model, len(tokenizer), args.steps, seconds, accuracy, evaluation)
    check_saved(args.out, DEMO_PROMPTS)


if __name__ == "__main__":
    main()
