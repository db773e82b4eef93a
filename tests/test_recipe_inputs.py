"""Bad input to the recipes ends with one `error:` line naming the file and line or the flag, exit status 2, before
any model loads: nothing is silently dropped, merged or re-typed. The model path here does not exist, so a test
that got as far as loading a model would fail on it instead."""

import json
import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from fat5.cli import CommandError
from fat5.recipes import classify, predict, summarization, train, translation
from fat5.recipes.data import read_table
from fat5.recipes.runner import one_line_worker_errors

NO_MODEL = "no-model-is-loaded"


def error_of(capsys, main, argv):
    """The one line a command prints on bad input (exit status 2)."""
    assert main([str(arg) for arg in argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def recipe_flags(tmp_path, train_file, *flags):
    return ["--model_name_or_path", NO_MODEL, "--output_dir", tmp_path / "out", "--report_to", "none",
            "--do_train", "--train_file", train_file, *flags]


def write(path, text, encoding="utf-8"):
    path.write_bytes(text.encode(encoding))
    return path


@pytest.fixture
def pairs(tmp_path):
    return write(tmp_path / "pairs.csv", "source,target\nthe cat,le chat\nthe dog,le chien\n")


@pytest.fixture
def model_folder(tmp_path):
    """Enough of a saved folder for fat5.recipes.predict's checks (the model is never loaded here)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


# ---------------------------------------------------------------------------------------------------- data files

@pytest.mark.parametrize("text, where, says", [
    # The quote opened on line 2 is never closed: the rest of the file would be one field.
    ('source,target\n"the cat,le chat\nthe dog,le chien\n', ":2:", "unclosed quote"),
    # Closed a line later: rows 2-3 merge into one field; the field count gives it away.
    ('source,target\n"the cat,le chat\nthe dog,le chien"\nthe owl,le hibou\n', ":2:", "lines 2-3"),
    ('source,target\n"the cat" sat,le chat\n', ":2:", "not valid CSV"),
    ('source,target\nthe cat,le chat,extra\nthe dog,le chien\n', ":2:", "3 fields where the header has 2"),
    ('source,target\nthe cat,le chat\nthe dog\n', ":3:", "1 fields where the header has 2"),
])
def test_csv_rows_are_never_merged_or_cut(tmp_path, capsys, text, where, says):
    data = write(tmp_path / "train.csv", text)
    line = error_of(capsys, train.main, recipe_flags(tmp_path, data))
    assert f"{data}{where}" in line and says in line


def test_csv_quoted_newlines_and_byte_order_mark_are_read(tmp_path):
    table = read_table(write(tmp_path / "train.csv", '\ufeffsource,target\n"line one\nline two",x\ny,z\n'))
    assert table.columns == {"source": ["line one\nline two", "y"], "target": ["x", "z"]}
    assert [table.where(row) for row in range(2)] == [f"{tmp_path / 'train.csv'}:2", f"{tmp_path / 'train.csv'}:4"]


def test_unusual_line_breaks_inside_values_are_kept(tmp_path):
    text = "a\u2028b\x0cc"
    jsonl = write(tmp_path / "train.jsonl", json.dumps({"source": text, "target": "x"}, ensure_ascii=False) + "\r\n")
    assert read_table(jsonl).columns == {"source": [text], "target": ["x"]}
    csv_file = write(tmp_path / "train.csv", f'source,target\r\n"{text}\r\nd",x\r\ne,f\r\n')
    assert read_table(csv_file).columns == {"source": [text + "\r\nd", "e"], "target": ["x", "f"]}


def test_non_utf8_file(tmp_path, capsys):
    data = write(tmp_path / "train.csv", "source,target\nthe cat,le chat\nthe café,le café\n", encoding="latin-1")
    line = error_of(capsys, train.main, recipe_flags(tmp_path, data))
    assert f"{data}:3: not UTF-8" in line and "0xe9" in line


@pytest.mark.parametrize("rows, where, says", [
    ([{"source": "a", "target": 1}, {"source": "b", "target": "x"}], ":2:", "holds a str ('x') where"),
    ([{"source": "a", "target": 1}, {"source": "b", "target": 1.5}], ":2:", "holds a float"),
    ([{"source": "a", "target": "x"}, {"source": "b"}], ":2:", "missing: ['target']"),
    ([{"source": "a", "target": "x"}, {"source": "b", "target": "y", "note": "z"}], ":2:", "extra: ['note']"),
])
def test_jsonl_rows_keep_their_keys_and_types(tmp_path, capsys, rows, where, says):
    data = write(tmp_path / "train.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    line = error_of(capsys, train.main, recipe_flags(tmp_path, data))
    assert f"{data}{where}" in line and says in line


def test_json_list_rows_are_named_by_position(tmp_path, capsys):
    data = write(tmp_path / "train.json", json.dumps([{"source": "a", "target": "x"}, {"source": "b", "target": 2}]))
    assert f"{data} row 2: column 'target' holds a int" in error_of(capsys, train.main, recipe_flags(tmp_path, data))


def test_empty_text_names_its_line(tmp_path, capsys):
    data = write(tmp_path / "train.tsv", "source\ttarget\nthe cat\tle chat\n \tle chien\n")
    assert f"{data}:3: column 'source' is empty" in error_of(capsys, translation.main, recipe_flags(tmp_path, data))


def test_tsv_is_read_as_tsv(tmp_path):
    # IANA text/tab-separated-values: a line is a row, a tab separates fields, quote characters are data.
    text = 'source\ttarget\r\n"the cat"\t"le chat"\r\nsay "hi\tdis ""salut""\n'
    data = write(tmp_path / "train.tsv", text)
    assert read_table(data).columns == {"source": ['"the cat"', 'say "hi'], "target": ['"le chat"', 'dis ""salut""']}
    # Asked for, CSV quote rules with tabs; the CSV-quoted value may then hold a tab and a line break.
    quoted = write(tmp_path / "quoted.tsv", 'source\ttarget\n"the\tcat\nsat"\t"le ""chat"""\n')
    assert read_table(quoted, tsv_quoting="csv").columns == {"source": ["the\tcat\nsat"], "target": ['le "chat"']}


def test_tsv_one_column_keeps_its_empty_values(tmp_path):
    assert read_table(write(tmp_path / "one.tsv", "text\na\n\nb\n")).columns == {"text": ["a", "", "b"]}


@pytest.mark.parametrize("text, where, says", [
    ('source\ttarget\n"the\tcat"\tle chat\n', ":2:", "3 fields where the header has 2"),
    ('source\ttarget\n"the cat\nsat"\tle chat\n', ":2:", "--tsv_quoting csv reads quoted values"),
    ("source\ttarget\nthe cat\tle chat\n\n", ":3:", "1 fields where the header has 2 (an empty line?"),
    ("source\ttarget\tsource\nthe cat\tle chat\tx\n", ":1:", "the header names a column twice"),
    ("\nthe cat\tle chat\n", ":1:", "the header naming the columns, is empty"),
])
def test_tsv_rows_are_never_merged_or_cut(tmp_path, capsys, text, where, says):
    data = write(tmp_path / "train.tsv", text)
    line = error_of(capsys, translation.main, recipe_flags(tmp_path, data))
    assert f"{data}{where}" in line and says in line


def test_csv_keeps_its_line_ends_and_header_rules(tmp_path, capsys):
    # The csv module ends a record at a lone "\r" as at "\n" and "\r\n"; line numbers count each.
    table = read_table(write(tmp_path / "train.csv", 'source,target\rthe cat,le chat\r\n"a\rb",c\nd,e'))
    assert table.columns == {"source": ["the cat", "a\rb", "d"], "target": ["le chat", "c", "e"]}
    assert table.where(2).endswith("train.csv:5")
    twice = write(tmp_path / "twice.csv", "source,target,target\na,b,c\n")
    assert f"{twice}:1: the header names a column twice" in error_of(capsys, train.main, recipe_flags(tmp_path, twice))


def jsonl_text(*rows):
    return "".join(json.dumps(row) + "\n" for row in rows)


@pytest.mark.parametrize("suffix, text, where, says", [
    (".jsonl", jsonl_text({"source": "a", "target": "x"}) + "\n" + jsonl_text({"source": "b", "target": "y"}),
     ":2:", "an empty line"),
    (".jsonl", '{"source": "a", "target": "x", "source": "b"}\n', ":1:", "names the key 'source' twice"),
    (".json", '[{"source": "a", "target": "x"},\n {"source": "b", "target": {"y": 1, "y": 2}}]', " row 2:",
     "names the key 'y' twice"),
    (".json", '[{"source": "a", "target": "x"},\n {"source": "b" "target": "y"}]', ":2:", "not JSON"),
    (".json", '[{"source": "a", "target": "x"}] []', ":1:", "more after the list"),
    (".json", '{"source": "a", "target": "x"}', ":", "expected a list of objects"),
    (".jsonl", jsonl_text({"source": "a", "target": "x"}) + '{"source": "b", "target": "\u00e9"}\n', ":2:",
     "not UTF-8 text (byte 0xe9)"),
    (".json", '[{"source": "a",\n"target": "x"}, {"source": "b",\n"target": "\u00e9"}]', ":3:",
     "not UTF-8 text (byte 0xe9)"),
    (".csv", "s\x00o\x00u\x00r\x00c\x00e\x00,\x00t\x00\n\x00", ":1:", "a NUL byte (UTF-16 text?)"),
    (".json", "[" * 100_000, ":", "nested too deeply"),
])
def test_json_and_encoding_errors_name_their_line(tmp_path, capsys, suffix, text, where, says):
    data = write(tmp_path / f"train{suffix}", text, encoding="latin-1" if "UTF-8" in says else "utf-8")
    line = error_of(capsys, train.main, recipe_flags(tmp_path, data))
    assert f"{data}{where}" in line and says in line


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl", ".json"])
def test_byte_order_mark_is_read_at_the_start_only(tmp_path, suffix):
    # Inside the file, a byte-order mark is a character of the value (a raw one, not a JSON escape).
    row = {"source": "\ufeffa", "target": "x"}
    text = {".csv": "source,target\n\ufeffa,x\n", ".tsv": "source\ttarget\n\ufeffa\tx\n",
            ".jsonl": json.dumps(row, ensure_ascii=False) + "\n", ".json": json.dumps([row], ensure_ascii=False)}
    table = read_table(write(tmp_path / f"train{suffix}", "\ufeff" + text[suffix]))
    assert table.columns == {"source": ["\ufeffa"], "target": ["x"]}


def test_json_list_is_read_as_json_reads_it(tmp_path, capsys):
    """A .json is read by json itself: long rows and escapes read as json.loads reads them, and an error names its
    line."""
    rows = [{"source": f"the {'very ' * row} old cat \u00e9\U0001f600\n\"{row}\"", "target": "x", "n": row * 1.5}
            for row in range(12)]
    for text in (json.dumps(rows), json.dumps(rows, indent=2, ensure_ascii=False)):
        table = read_table(write(tmp_path / "train.json", text))
        assert table.columns == {key: [row[key] for row in rows] for key in rows[0]}
    text = json.dumps(rows, indent=2)
    middle = text.index('"x"', len(text) // 2)
    broken = write(tmp_path / "broken.json", text[:middle] + '"x" "y"' + text[middle + 3:])
    with pytest.raises(json.JSONDecodeError) as caught:
        json.loads(broken.read_text())
    line = error_of(capsys, train.main, recipe_flags(tmp_path, broken))
    assert f"{broken}:{caught.value.lineno}: not JSON ({caught.value.msg})" in line


@pytest.mark.parametrize("suffix, template", [
    (".csv", 'source,target\n"{}",x\n'), (".tsv", "source\ttarget\n{}\tx\n"),
    (".jsonl", '{{"source": "{}", "target": "x"}}\n'), (".json", '[{{"source": "{}", "target": "x"}}]'),
])
def test_field_limit_is_a_flag(tmp_path, capsys, suffix, template):
    # Far over the 128 KB the csv module allows by default: read.
    long = write(tmp_path / f"long{suffix}", template.format("a" * 300_000))
    assert read_table(long).columns["source"] == ["a" * 300_000]
    assert read_table(write(tmp_path / f"train{suffix}", template.format("a" * 8)), max_field_chars=8)
    data = write(tmp_path / f"train{suffix}", template.format("a" * 9))
    line = error_of(capsys, train.main, recipe_flags(tmp_path, data, "--max_field_chars", 8))
    assert "a field longer than --max_field_chars=8 characters" in line and "raise --max_field_chars" in line
    assert str(data) in line


@pytest.mark.parametrize("suffix, text, where, says", [
    (".csv", 'source,target\n"the cat,le chat\n' + "the dog,le chien\n" * 100, ":2:", "a quote left open"),
    # One line, every later quote escaped: the string never closes.
    (".json", '[{"source": "the cat, ' + '\\"the dog\\", ' * 100 + "]", ":1:", "a JSON string never closed"),
])
def test_quote_left_open_stops_at_the_field_limit(tmp_path, capsys, suffix, text, where, says):
    data = write(tmp_path / f"train{suffix}", text)
    line = error_of(capsys, train.main, recipe_flags(tmp_path, data, "--max_field_chars", 40))
    assert f"{data}{where} a field longer than --max_field_chars=40" in line and says in line


# ------------------------------------------------------------------------------------------------- class labels

def nli(tmp_path, labels, suffix=".jsonl"):
    rows = [{"premise": "the cat sat", "hypothesis": "a cat sat", "label": label} for label in labels]
    if suffix == ".csv":
        return write(tmp_path / "nli.csv", "premise,hypothesis,label\n" + "".join(
            f"{row['premise']},{row['hypothesis']},{row['label']}\n" for row in rows))
    return write(tmp_path / f"nli{suffix}", "".join(json.dumps(row) + "\n" for row in rows))


def labels_of(path, **flags):
    return classify.prompts_and_labels(read_table(path), classify.ClassificationArguments(**flags))[1]


def test_json_booleans_are_never_class_indices(tmp_path, capsys):
    data = nli(tmp_path, [True, False])
    line = error_of(capsys, classify.main, recipe_flags(tmp_path, data))
    assert f"{data}:1: label 'true' is not one of --classes" in line


def test_labels_are_the_strings_they_are(tmp_path):
    boolean = nli(tmp_path, [True, False])
    assert labels_of(boolean, classes="false,true") == ["true", "false"]
    # A JSON integer indexes --classes; a JSON string is a name, digits or not.
    assert labels_of(nli(tmp_path, [0, 2])) == ["entailment", "contradiction"]
    with pytest.raises(CommandError, match="label '1' is not one of --classes"):
        labels_of(nli(tmp_path, ["1"]))
    # A CSV has no types: its numbers index --classes, as GLUE's files store them.
    assert labels_of(nli(tmp_path, ["neutral", 2], suffix=".csv")) == ["neutral", "contradiction"]


@pytest.mark.parametrize("labels, suffix, flags, says", [
    # Taken as written: nothing is stripped, and a CSV number is an index only as str(int) writes it.
    ([" neutral"], ".csv", {}, "label ' neutral' is not one of --classes"),
    (["02"], ".csv", {}, "label '02' is not one of --classes"),
    (["\u00b2"], ".csv", {}, "label '\u00b2' is not one of --classes"),
    # The integer 1 names the class "1" and indexes the class "2".
    ([1], ".jsonl", {"classes": "1,2,3"}, "label 1 is ambiguous: the class named '1' or the class at index 1"),
])
def test_labels_are_never_reshaped(tmp_path, labels, suffix, flags, says):
    with pytest.raises(CommandError, match=re.escape(says)):
        labels_of(nli(tmp_path, labels, suffix=suffix), **flags)


def test_integer_named_classes_at_their_own_index(tmp_path):
    assert labels_of(nli(tmp_path, [0, 1]), classes="0,1") == ["0", "1"]
    # A CSV's name wins over an index, as written: "1" is the class "1".
    assert labels_of(nli(tmp_path, ["1", "2"], suffix=".csv"), classes="1,2,3") == ["1", "2"]


@pytest.mark.parametrize("head", ["classifier", "text"])
def test_one_class_is_refused(tmp_path, capsys, head):
    # transformers would read num_labels=1 as a regression head.
    line = error_of(capsys, classify.main, recipe_flags(tmp_path, nli(tmp_path, ["neutral"]), "--head", head,
                                                        "--classes", "neutral"))
    assert "--classes neutral: name at least two classes" in line and "regression" in line


def test_every_class_is_in_the_training_rows(tmp_path, capsys):
    # RTE's labels (0 entailment, 1 not entailment) under MNLI's three classes: 1 would train as "neutral".
    data = nli(tmp_path, [0, 1, 1, 0])
    line = error_of(capsys, classify.main, recipe_flags(tmp_path, data))
    assert f"{data}: no training row holds the class 'contradiction' of --classes" in line
    line = error_of(capsys, classify.main, recipe_flags(tmp_path, nli(tmp_path, [0, 1, 2]), "--max_train_samples", 2))
    assert "no training row of the first 2 (--max_train_samples) holds the class 'contradiction'" in line


# --------------------------------------------------------------------------------------------------------- flags

@pytest.mark.parametrize("flags, says", [
    (["--merge_lora"], "--merge_lora has no effect without --lora"),
    (["--lora_r", "4"], "--lora_r has no effect without --lora"),
    (["--lora", "--lora_r", "0"], "--lora_r 0: must be at least 1"),
    (["--max_train_samples", "-1"], "--max_train_samples -1: must be at least 1"),
    (["--max_target_length", "0"], "--max_target_length 0: must be at least 1"),
    (["--generation_max_length", "8"], "--generation_max_length has no effect: nothing is generated"),
    (["--generation_num_beams", "2"], "--generation_num_beams has no effect"),
    (["--max_eval_samples", "2"], "--max_eval_samples has no effect without --do_eval"),
    (["--test_file", "x.csv"], "--test_file has no effect without --do_predict"),
    (["--no_such_flag", "1"], "--no_such_flag"),
    (["--num_train_epochs", "many"], "invalid float value: 'many'"),
    (["--tsv_quoting", "csv"], "--tsv_quoting csv has no effect without a .tsv data file"),
    (["--tsv_quoting", "tsv"], "invalid choice: 'tsv'"),
    (["--max_field_chars", "0"], "--max_field_chars 0: must be at least 1"),
    (["--dataset_config_name", "de-en"], "--dataset_config_name has no effect without --dataset_name"),
])
def test_seq2seq_flags(tmp_path, capsys, pairs, flags, says):
    assert says in error_of(capsys, translation.main, recipe_flags(tmp_path, pairs, *flags))


def test_flags_of_other_recipes(tmp_path, capsys, pairs):
    nli_file = nli(tmp_path, ["neutral"])
    assert "the classifier head does not generate" in error_of(capsys, classify.main, recipe_flags(
        tmp_path, nli_file, "--head", "classifier", "--do_eval", "--validation_file", nli_file,
        "--generation_max_length", "4"))
    assert "--do_predict: this recipe does not predict" in error_of(capsys, train.main, recipe_flags(
        tmp_path, pairs, "--do_predict", "--test_file", pairs))
    assert "--generation_max_length" in error_of(capsys, train.main, recipe_flags(
        tmp_path, pairs, "--generation_max_length", "4"))
    assert "--classes a,a: names must be non-empty and distinct" in error_of(capsys, classify.main, recipe_flags(
        tmp_path, nli_file, "--classes", "a,a"))
    assert "no column 'document'" in error_of(capsys, summarization.main, recipe_flags(tmp_path, pairs))


def test_dataset_name_offline(tmp_path, capsys, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    line = error_of(capsys, translation.main, ["--model_name_or_path", NO_MODEL, "--output_dir", tmp_path / "out",
                                               "--do_train", "--dataset_name", "someone/no-such-dataset"])
    assert line.startswith("error: --dataset_name someone/no-such-dataset: cannot load it (")


def test_field_limit_without_data_files(tmp_path, capsys):
    line = error_of(capsys, translation.main, ["--model_name_or_path", NO_MODEL, "--output_dir", tmp_path / "out",
                                               "--do_train", "--dataset_name", "someone/data", "--max_field_chars", 9])
    assert "--max_field_chars has no effect without a data file" in line


def test_output_dir_of_a_user_is_kept(tmp_path, capsys, pairs):
    occupied = tmp_path / "out"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("a user's file")
    assert "holds files that are not a FAT5 run's" in error_of(capsys, train.main, recipe_flags(tmp_path, pairs))
    assert (occupied / "notes.txt").read_text() == "a user's file"
    # The run folder's lock file is the only thing the refused run leaves (fat5/training/run_folder.py).
    assert {path.name for path in occupied.iterdir()} <= {"notes.txt", ".fat5_run.lock"}


# ------------------------------------------------------------------------------------------------------- predict

@pytest.mark.parametrize("flags, says", [
    (["--num_beams", "0"], "--num_beams 0: must be at least 1"),
    (["--max_new_tokens", "0"], "--max_new_tokens 0: must be at least 1"),
    (["--batch_size", "0"], "--batch_size 0: must be at least 1"),
    (["--max_predict_samples", "-1"], "--max_predict_samples -1: must be at least 1"),
    (["--length_penalty", "0.5"], "--length_penalty has no effect without beam search"),
    (["--device", "tpu9"], "--device tpu9:"),
    (["--source_column", "text"], "has no column 'text'"),
    (["--tsv_quoting", "csv"], "--tsv_quoting csv has no effect without a .tsv data file"),
    (["--max_field_chars", "4"], "a field longer than --max_field_chars=4 characters"),
])
def test_predict_flags(tmp_path, capsys, pairs, model_folder, flags, says):
    argv = ["--model", model_folder, "--input_file", pairs, "--output_file", tmp_path / "out.csv", *flags]
    assert says in error_of(capsys, predict.main, argv)
    assert not (tmp_path / "out.csv").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_predict_device_this_machine_lacks(tmp_path, capsys, pairs, model_folder):
    argv = ["--model", model_folder, "--input_file", pairs, "--output_file", tmp_path / "out.csv", "--device", "cuda"]
    assert "--device cuda: this machine has no cuda device" in error_of(capsys, predict.main, argv)


def test_predict_never_overwrites_its_input_or_a_folder(tmp_path, capsys, pairs, model_folder, monkeypatch):
    before = pairs.read_bytes()
    monkeypatch.chdir(tmp_path)
    for output in (pairs, "pairs.csv", f"./sub/../{pairs.name}"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        line = error_of(capsys, predict.main, ["--model", model_folder, "--input_file", pairs, "--output_file", output])
        assert "is the --input_file" in line
    assert pairs.read_bytes() == before
    line = error_of(capsys, predict.main, ["--model", model_folder, "--input_file", pairs, "--output_file", tmp_path])
    assert f"--output_file {tmp_path} is a folder" in line
    # The model folder is an input too: none of its files is replaced (a CSV there, such as a recipe's predictions,
    # is no file a model loads from).
    (Path(model_folder) / "tokenizer.json").write_text("{}")
    model_files = {path: path.read_bytes() for path in Path(model_folder).iterdir() if path.is_file()}
    for path in (Path(model_folder) / "config.json", Path(model_folder) / "tokenizer.json"):
        line = error_of(capsys, predict.main, ["--model", model_folder, "--input_file", pairs, "--output_file", path])
        assert f"--output_file {path} is a file of the --model folder" in line
    assert {path: path.read_bytes() for path in model_files} == model_files


class FakePipeline:
    """What predict uses of a text2text-generation pipeline: its model, and a call that says " le chat" (given a
    generator of texts, as predict gives them, a pipeline yields each text's list of generations as it goes)."""

    def __init__(self, weight=1.0):
        self.model = torch.nn.Linear(2, 1)
        with torch.no_grad():
            self.model.weight[0, 1] = weight

    def __call__(self, texts, **flags):
        return ([{"generated_text": " le chat"}] for _ in texts)


def test_predict_writes_references_as_written(tmp_path, capsys, model_folder, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "pipeline", lambda *args, **kwargs: FakePipeline())
    data = write(tmp_path / "test.tsv", "source\ttarget\nthe cat\t le chat \nthe dog\tle chien\n")
    argv = ["--model", model_folder, "--input_file", data, "--output_file", tmp_path / "out.csv",
            "--reference_column", "target"]
    assert predict.main([str(arg) for arg in argv]) == 0
    # Scored stripped, as the generated text is; written as given.
    assert json.loads(capsys.readouterr().out) == {"accuracy": 0.5}
    assert read_table(tmp_path / "out.csv").columns["reference"] == [" le chat ", "le chien"]


def test_predict_refuses_a_model_with_a_nan_weight_naming_it(tmp_path, capsys, model_folder, monkeypatch):
    """Not a CSV of empty predictions: one line naming the tensor, nothing written."""
    import transformers

    monkeypatch.setattr(transformers, "pipeline", lambda *args, **kwargs: FakePipeline(float("nan")))
    data = write(tmp_path / "test.csv", "source\nthe cat\n")
    line = error_of(capsys, predict.main, ["--model", model_folder, "--input_file", data, "--output_file",
                                           tmp_path / "out.csv"])
    assert line == f"error: --model {model_folder}: weight holds 1 NaN value, so it computes nothing useful; predict " \
                   f"with a checkpoint saved before its training diverged"
    assert not (tmp_path / "out.csv").exists()


# ------------------------------------------------------------------------------------------------ worker errors

class Failing(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        raise ValueError(f"row {index} is broken")


def test_data_loader_worker_error_is_one_line():
    with pytest.raises(CommandError) as caught, one_line_worker_errors():
        next(iter(DataLoader(Failing(), num_workers=1)))
    message = str(caught.value)
    assert "\n" not in message and "ValueError: row 0 is broken" in message
    assert "--dataloader_num_workers 0" in message
