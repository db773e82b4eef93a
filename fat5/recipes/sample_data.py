"""Write small data files for every recipe and for pretraining, generated here (nothing downloaded), so that the
commands of docs/fine-tuning.md and docs/pretraining.md run as written:

    fat5 sample-data data

Each task uses the words of the demo model's vocabulary (`./fat5-demo`, trained on "reverse:", "spell out:" and
"sort:" prompts over a few dozen words, fruits and number words), so fine-tuning it shows falling losses and
scores that mean something:

    translation_{train,dev,test}.tsv    number words -> digits (columns words, digits): a new task
    summaries_{train,dev,test}.jsonl    three clauses -> the first one (document, summary)
    pairs_{train,dev,test}.csv          the demo's own three tasks (source, target)
    nli_{train,dev,test}.json           premise / hypothesis -> entailment | neutral | contradiction (a JSON list)
    corpus/part-{0,1}.txt, domain.jsonl pretraining text: one document a line, and one {"text": ...} a line

The same seed gives the same files: a file already there with the same content is kept, and one with other content
is refused (nothing of the user's is replaced). Standard library only.
"""

import argparse
import csv
import io
import json
import os
import random
import shutil
from pathlib import Path

from fat5.cli import CliParser, CommandError, exit_with, run, write_failures_reported
from fat5.safe_files import StagedFolder, fsync_tree, signals_deferred

# The demo model's words (scripts/train_demo_t5.py).
ANIMALS = "cat dog bird fish fox cow hen owl".split()
VERBS = "sat ran saw ate sang slept".split()
PLACES = "mat box tree house road hill pond".split()
ADJECTIVES = "red big small old happy little blue green".split()
WORDS = ANIMALS + VERBS + PLACES + ADJECTIVES + "the a on in under by near one two".split()
FRUITS = ("apple apricot banana cherry date fig grape kiwi lemon lime mango melon olive orange papaya peach pear "
          "plum").split()
ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen").split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
LABELS = ("entailment", "neutral", "contradiction")
SPLITS = {"train": 1, "dev": 8, "test": 8}  # rows of a split: --rows divided by this
ROWS = 128  # 3 epochs of Trainer's default batches take 48 steps
MAX_ROWS = 100_000  # about 93 MB of files, made in memory in 6 s: sample data, not a data set


def spell(number):
    if number < 20:
        return ONES[number]
    if number < 100:
        return TENS[number // 10] + ("" if number % 10 == 0 else " " + ONES[number % 10])
    return ONES[number // 100] + " hundred" + ("" if number % 100 == 0 else " " + spell(number % 100))


def clause(rng):
    return f"the {rng.choice(ADJECTIVES)} {rng.choice(ANIMALS)} {rng.choice(VERBS)} on the {rng.choice(PLACES)}"


def translation_row(rng, _):
    number = rng.randrange(1000)
    return {"words": spell(number), "digits": str(number)}


def summary_row(rng, _):
    clauses = [clause(rng) for _ in range(3)]
    return {"document": " and ".join(clauses), "summary": clauses[0]}


def pair_row(rng, _):
    task = rng.randrange(3)
    if task == 0:
        words = rng.choices(WORDS, k=rng.randint(3, 7))
        return {"source": "reverse: " + " ".join(words), "target": " ".join(reversed(words))}
    if task == 1:
        number = rng.randrange(1000)
        return {"source": f"spell out: {number}", "target": spell(number)}
    fruits = rng.sample(FRUITS, rng.randint(2, 6))
    return {"source": "sort: " + " ".join(fruits), "target": " ".join(sorted(fruits))}


def nli_row(rng, index):
    """Premise "the A V on the P"; the hypothesis keeps A and V (entailment), changes V (contradiction) or changes A
    (neutral: another animal may have done it too)."""
    animal, verb, place = rng.choice(ANIMALS), rng.choice(VERBS), rng.choice(PLACES)
    label = LABELS[index % 3]
    if label == "contradiction":
        verb_said, animal_said = rng.choice([other for other in VERBS if other != verb]), animal
    elif label == "neutral":
        verb_said, animal_said = verb, rng.choice([other for other in ANIMALS if other != animal])
    else:
        verb_said, animal_said = verb, animal
    return {"premise": f"the {animal} {verb} on the {place}", "hypothesis": f"the {animal_said} {verb_said}",
            "label": label}


def document(rng):
    return " and ".join(clause(rng) for _ in range(rng.randint(2, 8))) + " ."


def table(rows, delimiter):
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(rows[0]), delimiter=delimiter, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


def json_lines(rows):
    return "".join(json.dumps(row) + "\n" for row in rows)


# name: (row maker, file suffix, how the rows become text)
TASKS = {
    "translation": (translation_row, ".tsv", lambda rows: table(rows, "\t")),
    "summaries": (summary_row, ".jsonl", json_lines),
    "pairs": (pair_row, ".csv", lambda rows: table(rows, ",")),
    "nli": (nli_row, ".json", lambda rows: json.dumps(rows, indent=1) + "\n"),
}


def sample_files(rows, seed=0):
    """{relative path: text} of every file, `rows` training rows a task (an eighth of that for dev and test)."""
    rng = random.Random(seed)
    files = {}
    for name, (make, suffix, text) in TASKS.items():
        for split, fraction in SPLITS.items():
            files[f"{name}_{split}{suffix}"] = text([make(rng, index) for index in range(max(rows // fraction, 3))])
    documents = [document(rng) for _ in range(3 * rows)]
    files["corpus/part-0.txt"] = "\n".join(documents[:rows]) + "\n"
    files["corpus/part-1.txt"] = "\n".join(documents[rows:2 * rows]) + "\n"
    files["domain.jsonl"] = json_lines({"text": text} for text in documents[2 * rows:])
    return files


def write_files(folder, files):
    """Write `files` into `folder` whole or not at all: a file already there is kept when it holds the same text,
    and refused, before anything is written, when it does not; the others are written into a staging folder beside
    `folder` (fat5/safe_files.py), flushed, then renamed into place with Ctrl-C held, so that a failed write (a full
    disk) leaves nothing of them. Returns the names written."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise CommandError(f"{folder} exists and is not a folder")
    for name, text in files.items():
        path = folder / name
        if path.exists() and (not path.is_file() or path.read_bytes() != text.encode()):
            raise CommandError(f"{path} exists with other content (another --rows or --seed, or a file of yours); "
                               f"choose another folder")
    written = [name for name in files if not (folder / name).exists()]
    if not written:
        return written
    needed = sum(len(files[name].encode()) for name in written)
    existing = next(path for path in (folder, *folder.absolute().parents) if path.is_dir())
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise CommandError(f"the sample files need {needed / 2**20:.1f} MiB and the disk of {existing} has "
                           f"{free / 2**20:.1f} MiB free: choose fewer --rows or another folder")
    with write_failures_reported(f"the sample files into {folder}", folder), StagedFolder(folder) as staging:
        for name in written:
            (staging.path / name).parent.mkdir(parents=True, exist_ok=True)
            (staging.path / name).write_text(files[name], encoding="utf-8")
        fsync_tree(staging.path)
        with signals_deferred():
            for name in written:
                (folder / name).parent.mkdir(parents=True, exist_ok=True)
                os.rename(staging.path / name, folder / name)
    return written


def build_parser():
    parser = CliParser(prog="fat5 sample-data", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("folder", metavar="DIR", help="where to write the files (made if missing)")
    parser.add_argument("--rows", type=int, default=ROWS, help=f"training rows a task; dev and test get an eighth "
                                                              f"(default: {ROWS}; at most {MAX_ROWS:,})")
    parser.add_argument("--seed", type=int, default=0, help="the random seed the rows are drawn with (default: 0)")
    return parser


def sample_data(argv, progress):
    args = build_parser().parse_args(argv)
    if not args.folder.strip():
        raise CommandError(f"DIR {args.folder!r} names no folder: give one, such as data")
    if not 3 <= args.rows <= MAX_ROWS:
        raise CommandError(f"--rows {args.rows}: must be between 3 and {MAX_ROWS:,} (sample files to try the "
                           f"commands on; {MAX_ROWS:,} rows make about 93 MB)")
    files = sample_files(args.rows, args.seed)
    written = write_files(args.folder, files)
    kept = len(files) - len(written)
    print(f"wrote {len(written)} sample files to {args.folder}" + (f" ({kept} already there)" if kept else ""))


def main(argv=None):
    return run(sample_data, argv)


if __name__ == "__main__":
    exit_with(main)
