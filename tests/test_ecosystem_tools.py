"""Tools a T5 user embeds, serves and ships models with, on a FAT5 folder as on a T5 one: sentence-transformers,
CTranslate2, pickle (a fresh process), and the tokenizer route on transformers 5. Each runs as a Hub user runs it
(a process that cannot import this repository, the folder's own code with trust_remote_code) unless it says
otherwise; the demo T5 and its FAT5 conversion are the pair compared."""

import json
import pickle
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from fat5 import FAT5Config, FAT5EncoderModel, FAT5ForConditionalGeneration
from fat5.convert.demo import DEMO_CHECKPOINT, DEMO_PROMPTS
from isolated import run_isolated
from t5_twins import TRANSFORMERS_5, close

PROMPTS = [prompt for prompt, _ in DEMO_PROMPTS]
ANSWERS = [answer for _, answer in DEMO_PROMPTS]


# -- sentence-transformers -------------------------------------------------------------------------------------------

EMBED = """
import json, sys
from sentence_transformers import SentenceTransformer

folder, sentences, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
model = SentenceTransformer(folder, trust_remote_code=True, device="cpu")
embeddings = model.encode(sentences, convert_to_tensor=True)
json.dump({"encoder": type(model[0].auto_model).__name__, "embeddings": embeddings.tolist()}, open(out, "w"))
"""


def embed(folder, tmp_path):
    result = run_isolated(EMBED, [folder, json.dumps(PROMPTS)], tmp_path)
    return result["encoder"], torch.tensor(result["embeddings"])


def test_sentence_transformers_embeds_a_fat5_folder_as_the_t5_one(demo_fat5, tmp_path):
    """`SentenceTransformer(folder, trust_remote_code=True)`: sentence-transformers loads T5's encoder alone
    (T5EncoderModel) and FAT5's (FAT5EncoderModel), pools the same, and the embeddings are the same; also for a
    folder saved by the encoder class, and in a process that imported FAT5."""
    pytest.importorskip("sentence_transformers")
    t5_encoder, expected = embed(DEMO_CHECKPOINT, tmp_path)
    fat5_encoder, embeddings = embed(demo_fat5, tmp_path)
    assert (t5_encoder, fat5_encoder) == ("T5EncoderModel", "FAT5EncoderModel")
    assert close(embeddings, expected)
    encoder_folder = tmp_path / "encoder"
    FAT5EncoderModel.from_pretrained(demo_fat5).save_pretrained(encoder_folder)
    AutoTokenizer.from_pretrained(DEMO_CHECKPOINT).save_pretrained(encoder_folder)
    assert close(embed(encoder_folder, tmp_path)[1], expected)
    from sentence_transformers import SentenceTransformer

    in_process = SentenceTransformer(str(demo_fat5), trust_remote_code=True, device="cpu")
    assert close(in_process.encode(PROMPTS, convert_to_tensor=True), expected)


# -- CTranslate2 -----------------------------------------------------------------------------------------------------


def ct2_greedy(out, tokenizer, prompts, max_tokens):
    import ctranslate2

    translator = ctranslate2.Translator(str(out), device="cpu")
    results = translator.translate_batch([tokenizer.convert_ids_to_tokens(tokenizer(prompt).input_ids)
                                          for prompt in prompts], beam_size=1, max_decoding_length=max_tokens)
    return [tokenizer.convert_tokens_to_ids(result.hypotheses[0]) for result in results]


def pytorch_greedy(folder, tokenizer, prompts, max_tokens):
    """PyTorch's greedy tokens per prompt, without the start token and what follows the end token."""
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokens = []
    for prompt in prompts:
        with torch.no_grad():
            generated = model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=max_tokens,
                                       do_sample=False)[0, 1:].tolist()
        tokens.append(generated[:generated.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in generated
                      else generated)
    return tokens


def test_the_ct2_command_gives_pytorchs_greedy_tokens(demo_fat5, tmp_path, capsys):
    pytest.importorskip("ctranslate2")
    from fat5.convert.ct2_fat5 import main as ct2_main

    assert ct2_main([str(demo_fat5), str(tmp_path / "ct2")]) == 0
    assert "Check: CTranslate2 decodes a sample to PyTorch's" in capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "ct2")  # the command copies the tokenizer files
    tokens = ct2_greedy(tmp_path / "ct2", tokenizer, PROMPTS, 32)
    assert tokens == pytorch_greedy(demo_fat5, tokenizer, PROMPTS, 32)
    assert tokenizer.batch_decode(tokens, skip_special_tokens=True) == ANSWERS


CT2_OWN_CONVERTER = """
import json, sys
from ctranslate2.converters.transformers import main

folder, out, result = sys.argv[1], sys.argv[2], sys.argv[3]
sys.argv = ["ct2-transformers-converter", "--model", folder, "--output_dir", out, "--trust_remote_code"]
main()
json.dump({}, open(result, "w"))
"""


def test_ctranslate2s_own_converter_takes_a_fat5_folder(demo_fat5, tmp_path):
    """`ct2-transformers-converter --model FOLDER --trust_remote_code`, as for a T5 folder: loading the folder's
    config registers CTranslate2's T5 loader for FAT5Config (fat5/integrations_fat5.py)."""
    pytest.importorskip("ctranslate2")
    run_isolated(CT2_OWN_CONVERTER, [demo_fat5, tmp_path / "ct2"], tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(demo_fat5, trust_remote_code=True)
    assert tokenizer.batch_decode(ct2_greedy(tmp_path / "ct2", tokenizer, PROMPTS, 32),
                                  skip_special_tokens=True) == ANSWERS


# (tie_word_embeddings, scale_decoder_outputs, relative_bias_per_layer): T5 v1.0, a tied head without the
# rescale (CTranslate2's T5 loader would infer the rescale from the tying), and umT5's bias table per layer.
VARIANTS = [(True, True, False), (True, False, False), (False, False, True)]


@pytest.mark.parametrize("tied, scaled, per_layer", VARIANTS, ids=["t5-v1.0", "tied-unscaled", "umt5"])
def test_ct2_conversions_of_every_t5_variant_decode_as_pytorch(tmp_path, tied, scaled, per_layer):
    pytest.importorskip("ctranslate2")
    from fat5.convert.ct2_fat5 import main as ct2_main

    tokenizer = AutoTokenizer.from_pretrained(DEMO_CHECKPOINT)
    config = FAT5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                        dropout_rate=0.0, feed_forward_proj="gated-gelu", tie_word_embeddings=tied,
                        scale_decoder_outputs=scaled, relative_bias_per_layer=per_layer)
    torch.manual_seed(0)
    model = FAT5ForConditionalGeneration(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.6)  # confident, varied greedy choices
    model.save_pretrained(tmp_path / "fat5")
    tokenizer.save_pretrained(tmp_path / "fat5")
    assert ct2_main([str(tmp_path / "fat5"), str(tmp_path / "ct2"), "--no-verify"]) == 0
    expected = pytorch_greedy(tmp_path / "fat5", tokenizer, PROMPTS, 8)
    assert len({token for tokens in expected for token in tokens}) >= 4
    assert ct2_greedy(tmp_path / "ct2", tokenizer, PROMPTS, 8) == expected


def test_ct2_refuses_what_ctranslate2s_t5_cannot_compute_in_one_line(tmp_path, capsys, tiny_config):
    pytest.importorskip("ctranslate2")
    from fat5.convert.ct2_fat5 import main as ct2_main

    refused = {"fire": dict(position_encoding_type="fire"), "scaled": dict(attention_scale=0.5)}
    for name, fields in refused.items():
        FAT5ForConditionalGeneration(tiny_config(**fields)).save_pretrained(tmp_path / name)
    capsys.readouterr()
    for name in refused:
        assert ct2_main([str(tmp_path / name), str(tmp_path / f"{name}-out")]) == 2
        assert not (tmp_path / f"{name}-out").exists()
    errors = capsys.readouterr().err.splitlines()
    assert errors == ["error: position_encoding_type 'fire' has no CTranslate2 conversion: only 't5' (T5's relative "
                      "bias) exports to CTranslate2",
                      "error: attention_scale 0.5 has no CTranslate2 conversion: T5's is 1.0"]
    assert ct2_main([str(DEMO_CHECKPOINT), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: {DEMO_CHECKPOINT} is a 't5' model, not a FAT5 one\n"


@pytest.mark.parametrize("head", ["FAT5ForSequenceClassification", "FAT5ForTokenClassification",
                                  "FAT5ForQuestionAnswering", "FAT5EncoderModel", "FAT5Model"])
def test_ct2_refuses_a_folder_whose_head_ctranslate2_has_not_in_one_line(demo_fat5, tmp_path, capsys, head):
    """CTranslate2's T5 is a seq2seq model: a classifier's folder gave 61 lines of traceback, or a check that blamed
    CTranslate2 for the decoder and LM head the folder does not have."""
    pytest.importorskip("ctranslate2")
    import fat5
    from fat5.convert.ct2_fat5 import main as ct2_main

    folder = tmp_path / "model"
    getattr(fat5, head).from_pretrained(demo_fat5).save_pretrained(folder)
    AutoTokenizer.from_pretrained(demo_fat5).save_pretrained(folder)
    capsys.readouterr()
    assert ct2_main([str(folder), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"error: {folder} holds a {head} (config.json architectures): the CTranslate2 "
                                       "export takes a FAT5ForConditionalGeneration\n")
    assert not (tmp_path / "out").exists()


def test_ct2_refuses_non_finite_weights_and_a_folder_without_tokenizer_in_one_line(demo_fat5, tmp_path, capsys):
    """A NaN weight made PyTorch and CTranslate2 decode differently, which the check blamed on ctranslate2."""
    import shutil

    from safetensors.torch import load_file, save_file

    pytest.importorskip("ctranslate2")
    from fat5.convert.ct2_fat5 import main as ct2_main

    shutil.copytree(demo_fat5, tmp_path / "nan")
    weights = load_file(tmp_path / "nan" / "model.safetensors")
    weights["decoder.final_layer_norm.weight"][2] = torch.nan
    save_file(weights, tmp_path / "nan" / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(demo_fat5, tmp_path / "untokenized", ignore=shutil.ignore_patterns("tokenizer*", "spiece*",
                                                                                        "special_tokens*"))
    capsys.readouterr()
    assert ct2_main([str(tmp_path / "nan"), str(tmp_path / "out")]) == 2
    assert ct2_main([str(tmp_path / "untokenized"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: tensor decoder.final_layer_norm.weight of {tmp_path / 'nan' / 'model.safetensors'} holds NaN or "
        "infinite values: the CTranslate2 export refuses a model with non-finite weights",
        f"error: FOLDER {tmp_path / 'untokenized'} holds no tokenizer (tokenizer_config.json or tokenizer.json): "
        "CTranslate2 takes its vocabulary from the tokenizer"]
    assert not (tmp_path / "out").exists()


# -- pickle ----------------------------------------------------------------------------------------------------------

PICKLE_A_HUB_MODEL = """
import copy, json, pickle, sys
import torch
from transformers import AutoModelForSeq2SeqLM

folder, pickled, out = sys.argv[1], sys.argv[2], sys.argv[3]
model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
ids = torch.tensor([[5, 9, 12, 7, 1]])
with torch.no_grad():
    logits = model(input_ids=ids, decoder_input_ids=torch.tensor([[0, 4, 6]])).logits
open(pickled, "wb").write(pickle.dumps(model))
copies = [copy.copy(model), copy.deepcopy(model), copy.copy(model.config), copy.deepcopy(model.config)]
json.dump({"module": type(model).__module__, "logits": logits.tolist(),
           "copies_keep_the_class": [type(made) is type(original) for made, original in
                                     zip(copies, [model, model, model.config, model.config])]}, open(out, "w"))
"""
UNPICKLE = """
import json, pickle, sys
import torch

pickled, out = sys.argv[1], sys.argv[2]
model = pickle.loads(open(pickled, "rb").read())
with torch.no_grad():
    logits = model(input_ids=torch.tensor([[5, 9, 12, 7, 1]]), decoder_input_ids=torch.tensor([[0, 4, 6]])).logits
json.dump({"module": type(model).__module__, "logits": logits.tolist(),
           "dropout": model.config.attention_dropout_rate}, open(out, "w"))
"""


def test_a_model_loaded_with_trust_remote_code_unpickles_in_a_fresh_process(demo_fat5, tmp_path):
    """As T5's models do (their classes are transformers'): the class comes from the folder's code, which the
    fresh process imports from transformers' module cache."""
    pickled = tmp_path / "model.pkl"
    saved = run_isolated(PICKLE_A_HUB_MODEL, [demo_fat5, pickled], tmp_path)
    assert saved["module"].startswith("transformers_modules.") and all(saved["copies_keep_the_class"])
    loaded = run_isolated(UNPICKLE, [pickled], tmp_path)
    assert loaded["module"] == saved["module"] and loaded["dropout"] == 0.0
    assert torch.equal(torch.tensor(loaded["logits"]), torch.tensor(saved["logits"]))


def test_a_model_of_the_installed_package_unpickles_in_a_fresh_process(demo_fat5, tmp_path):
    model = FAT5ForConditionalGeneration.from_pretrained(demo_fat5).eval()
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(model))
    child = subprocess.run([sys.executable, "-c", UNPICKLE, str(tmp_path / "model.pkl"), str(tmp_path / "out.json")],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    loaded = json.loads((tmp_path / "out.json").read_text())
    assert loaded["module"] == "fat5.modeling_fat5"
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([[5, 9, 12, 7, 1]]), decoder_input_ids=torch.tensor([[0, 4, 6]]))
    assert torch.equal(torch.tensor(loaded["logits"]), expected.logits)


# -- the tokenizer without trust_remote_code -------------------------------------------------------------------------

TOKENIZE = """
import json, sys
from transformers import AutoTokenizer

folder, trust, import_fat5, out = sys.argv[1], sys.argv[2] == "trust", sys.argv[3] == "fat5", sys.argv[4]
if import_fat5:
    from fat5 import FAT5Config  # noqa: F401  (the first use of a class registers FAT5 with the Auto classes)
tokenizer = AutoTokenizer.from_pretrained(folder, **({"trust_remote_code": True} if trust else {}))
json.dump({"class": type(tokenizer).__name__, "ids": tokenizer("reverse: the cat sat").input_ids}, open(out, "w"))
"""


@pytest.mark.parametrize("route", ["trust_remote_code", "fat5 used", "neither"])
def test_the_tokenizer_loads_without_a_question_by_the_documented_routes(demo_fat5, tmp_path, route):
    """transformers 5 reads config.json first and asks whether to run the folder's code when `trust_remote_code`
    is not given (no file in the folder can avoid that: docs/using.md, "Tokenizer"); with it, or in a process that used
    FAT5's classes, it asks nothing. transformers 4.57 never asks. Every route loads the T5 tokenizer."""
    args = [demo_fat5, "trust" if route == "trust_remote_code" else "-", "fat5" if route == "fat5 used" else "-"]
    if route == "fat5 used":  # a process where FAT5 is installed: the repository stays importable
        child = subprocess.run([sys.executable, "-c", TOKENIZE, *map(str, args), str(tmp_path / "out.json")],
                               capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert child.returncode == 0, child.stderr[-2000:]
        result, output = json.loads((tmp_path / "out.json").read_text()), child.stdout + child.stderr
    else:
        result, output = run_isolated(TOKENIZE, args, tmp_path, with_output=True)
    expected = AutoTokenizer.from_pretrained(DEMO_CHECKPOINT)
    assert result["class"] == type(expected).__name__
    assert result["ids"] == expected("reverse: the cat sat").input_ids
    asked = "Do you wish to run the custom code?" in output
    assert asked == (TRANSFORMERS_5 and route == "neither")

