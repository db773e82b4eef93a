"""The behaviours transformers' own model tests (`ModelTesterMixin`, `GenerationTesterMixin`) check on T5, checked
on every FAT5 class in our own words. Where T5 answers the same question, T5 built from the same config is the spec;
docs/using.md ("How FAT5 differs from transformers' T5") says where FAT5 differs on purpose."""

import copy
import functools
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import T5Config, T5ForConditionalGeneration, T5ForTokenClassification, Trainer, TrainingArguments
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

import fat5
from fat5 import FAT5Config, FAT5ForConditionalGeneration
from fat5.compat_fat5 import cache_field, output_cache
from t5_twins import (
    EAGER,
    ENCODER_DECODER,
    ENCODER_ONLY,
    SHAPES,
    T5_OF,
    TRANSFORMERS_5,
    VOCAB,
    build,
    close,
    generate_inputs,
    inputs_for,
    needs_transformers_5,
    run,
)

FAT5_CLASSES = list(T5_OF)
by_name = {"ids": lambda model_class: model_class.__name__}


def first_tensor(output):
    """The output a user reads first (logits, start logits or the last hidden state)."""
    return next(value for value in output.to_tuple() if isinstance(value, torch.Tensor) and value.dim() > 1)


def labelled_inputs(model_class):
    """Inputs with the labels of each head, so every class returns a loss."""
    inputs = inputs_for(model_class)
    if model_class is FAT5ForConditionalGeneration:
        inputs["labels"] = inputs.pop("decoder_input_ids")
    elif model_class is fat5.FAT5ForTokenClassification:
        inputs["labels"] = torch.tensor([[0, 1, 2, 1, 0, 2], [2, 1, 0, 1, -100, -100]])
    elif model_class is fat5.FAT5ForSequenceClassification:
        inputs["labels"] = torch.tensor([0, 2])
    elif model_class is fat5.FAT5ForQuestionAnswering:
        inputs["start_positions"], inputs["end_positions"] = torch.tensor([1, 0]), torch.tensor([3, 2])
    return inputs


def loss_of(output):
    """The loss of a head, or, for the classes that have none, a fixed random projection of the output (not its
    mean square: after the final RMSNorm that is constant)."""
    if getattr(output, "loss", None) is not None:
        return output.loss
    features = first_tensor(output)
    projection = torch.randn(features.shape, generator=torch.Generator().manual_seed(0))
    return (features * projection).sum()


# -- outputs -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_each_row_alone_gives_its_row_of_the_batch(model_class):
    model = build(model_class)
    batch = inputs_for(model_class)
    together = first_tensor(run(model))
    with torch.no_grad():
        for row in range(2):
            alone = model(**{name: tensor[row:row + 1] for name, tensor in batch.items()})
            assert close(first_tensor(alone)[0], together[row])


@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_two_calls_in_eval_mode_give_identical_outputs(model_class):
    model = build(model_class, dropout_rate=0.3)
    assert torch.equal(first_tensor(run(model)), first_tensor(run(model)))


@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_inputs_embeds_give_the_outputs_of_their_input_ids(model_class):
    model = build(model_class)
    inputs = inputs_for(model_class)
    embed = model.get_input_embeddings()
    with torch.no_grad():
        from_embeds = {"inputs_embeds": embed(inputs.pop("input_ids")), **inputs}
        if "decoder_input_ids" in inputs:
            from_embeds["decoder_inputs_embeds"] = embed(from_embeds.pop("decoder_input_ids"))
        assert close(first_tensor(model(**from_embeds)), first_tensor(run(model)))


OUTPUT_FIELDS = ("hidden_states", "attentions", "encoder_hidden_states", "encoder_attentions",
                 "decoder_hidden_states", "decoder_attentions", "cross_attentions")


@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_attention_and_hidden_state_shapes_are_t5s(model_class):
    def shapes(output):
        return {name: [tuple(tensor.shape) for tensor in output[name]] for name in OUTPUT_FIELDS
                if output.get(name)}

    flags = {"output_attentions": True, "output_hidden_states": True}
    assert shapes(run(build(model_class, **EAGER), **flags)) == shapes(run(build(T5_OF[model_class], **EAGER),
                                                                               **flags))


@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_returned_hidden_states_and_attentions_keep_their_gradients(model_class):
    model = build(model_class, **EAGER).train()
    output = model(**inputs_for(model_class), output_attentions=True, output_hidden_states=True)
    kept = [output[name][0] for name in OUTPUT_FIELDS if output.get(name)]
    assert len(kept) == (5 if model_class in ENCODER_DECODER else 2)
    for tensor in kept:
        tensor.retain_grad()
    first_tensor(output).sum().backward()
    assert all(tensor.grad is not None and tensor.grad.abs().sum() > 0 for tensor in kept)


@pytest.mark.parametrize("model_class", ENCODER_ONLY, **by_name)
def test_encoder_only_classes_say_so_in_their_config_as_t5s_do(model_class):
    config = FAT5Config(**SHAPES)
    model = model_class(config)
    t5_twin = T5_OF[model_class](T5Config(**SHAPES))
    described = ("is_encoder_decoder", "use_cache")
    assert {field: getattr(model.config, field) for field in described} == {
        field: getattr(t5_twin.config, field) for field in described}
    # Unlike T5's, the caller's config is left as it was (it may still build the seq2seq model).
    assert config.is_encoder_decoder and config.use_cache


def test_labels_alone_give_the_loss_of_labels_with_their_shifted_decoder_inputs():
    model = build(FAT5ForConditionalGeneration)
    inputs = labelled_inputs(type(model))
    with torch.no_grad():
        from_labels = model(**inputs).loss
        shifted = model(**inputs, decoder_input_ids=model._shift_right(inputs["labels"])).loss
    assert torch.equal(from_labels, shifted)


PROBLEM_TYPES = [
    pytest.param(None, 3, torch.tensor([0, 2]), "single_label_classification", id="inferred-single-label"),
    pytest.param(None, 3, torch.tensor([[1.0, 0, 1], [0, 1, 0]]), "multi_label_classification",
                 id="inferred-multi-label"),
    pytest.param(None, 1, torch.tensor([0.5, -1.0]), "regression", id="inferred-regression"),
    pytest.param("regression", 3, torch.tensor([[0.5, 1, 2], [0, 1, -1]]), "regression", id="set-regression"),
]


@pytest.mark.parametrize("problem_type, num_labels, labels, expected_type", PROBLEM_TYPES)
def test_sequence_classification_follows_the_problem_type(problem_type, num_labels, labels, expected_type):
    model = build(fat5.FAT5ForSequenceClassification, num_labels=num_labels, problem_type=problem_type)
    inputs = inputs_for(fat5.FAT5ForSequenceClassification)
    with torch.no_grad():
        output = model(**inputs, labels=labels)
    logits = output.logits.float()
    expected = {"single_label_classification": lambda: F.cross_entropy(logits, labels),
                "multi_label_classification": lambda: F.binary_cross_entropy_with_logits(logits, labels),
                "regression": lambda: F.mse_loss(logits.squeeze(), labels.squeeze())}[expected_type]()
    assert model.config.problem_type == expected_type
    assert torch.allclose(output.loss, expected, rtol=1e-6, atol=0)


@needs_transformers_5
@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_forward_takes_t5s_arguments_in_t5s_order(model_class):
    """So positional calls written for T5 mean the same. FAT5's sequence-classification and QA heads are
    encoder-only (T5's take decoder inputs), so they follow T5's encoder."""

    def arguments(cls):
        # transformers 5.24 renamed the cache argument; FAT5 takes `cache` in its place on every release (and
        # `past_key_values` as a keyword).
        return [{"past_key_values": "cache"}.get(name, name) for name in inspect.signature(cls.forward).parameters
                if name not in ("self", "kwargs")]

    ours, t5s = arguments(model_class), arguments(T5_OF[model_class])
    assert model_class.main_input_name == "input_ids"
    assert ours[:len(t5s)] == t5s


# -- weights, saving and loading ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_every_class_saves_and_loads_to_identical_outputs(model_class, tmp_path):
    model = build(model_class)
    model.save_pretrained(tmp_path)
    loaded, info = model_class.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert torch.equal(first_tensor(run(loaded.eval())), first_tensor(run(model)))


@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_every_class_builds_on_the_meta_device(model_class):
    with torch.device("meta"):
        model = model_class(FAT5Config(**SHAPES))
    assert all(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()])


def weights_file_without(folder, *names, **replaced):
    """Rewrite `folder`'s weights file without the tensors `names`, with the tensors `replaced`."""
    weights = {name: tensor for name, tensor in load_file(folder / "model.safetensors").items() if name not in names}
    save_file({**weights, **replaced}, folder / "model.safetensors", metadata={"format": "pt"})


def on_meta(model):
    return [name for name, tensor in model.named_parameters(remove_duplicate=False) if tensor.is_meta]


@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_a_weights_file_without_the_models_weights_reports_every_weight_missing_as_t5s_does(model_class, tmp_path):
    """transformers' `test_model_weights_reload_no_missing_tied_weights`: every parameter of a folder whose weights
    file holds none of the model's tensors is reported missing, and none is left on the meta device. The names
    reported beyond `named_parameters()` are tied ones (the stacks' embeddings, a tied head), as T5's."""
    reports = {}
    for built_class in (model_class, T5_OF[model_class]):
        folder = tmp_path / built_class.__name__
        build(built_class).save_pretrained(folder)
        weights_file_without(folder, *load_file(folder / "model.safetensors"), tensor=torch.tensor([1, 2]))
        loaded, info = built_class.from_pretrained(folder, output_loading_info=True)
        names, missing = {name for name, _ in loaded.named_parameters()}, set(info["missing_keys"])
        assert names <= missing, (built_class, names - missing)
        assert not on_meta(loaded), built_class
        reports[built_class] = {name.removeprefix("transformer.") for name in missing - names}
    tied = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}
    assert reports[model_class] <= tied and reports[T5_OF[model_class]] <= tied
    if model_class in ENCODER_DECODER:
        assert reports[model_class] - {"lm_head.weight"} == reports[T5_OF[model_class]] - {"lm_head.weight"}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("model_class", [FAT5ForConditionalGeneration, fat5.FAT5EncoderModel], **by_name)
def test_a_weights_file_without_the_embedding_reports_it_missing(model_class, tied, tmp_path):
    """The embedding (`shared.weight`) absent: reported missing with its stack names, created and initialised
    rather than left on the meta device, and tied as the config says; every other weight loaded."""
    model = build(model_class, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    weights_file_without(tmp_path, "shared.weight", "lm_head.weight")
    loaded, info = model_class.from_pretrained(tmp_path, output_loading_info=True)
    assert "shared.weight" in info["missing_keys"] and not on_meta(loaded)
    assert ("lm_head.weight" in info["missing_keys"]) == (model_class is FAT5ForConditionalGeneration)
    assert loaded.encoder.embed_tokens.weight is loaded.shared.weight
    if model_class is FAT5ForConditionalGeneration:
        assert loaded.decoder.embed_tokens.weight is loaded.shared.weight
        assert (loaded.lm_head.weight is loaded.shared.weight) == tied
    saved = model.state_dict()
    assert all(torch.equal(tensor, saved[name]) for name, tensor in loaded.state_dict().items()
               if "embed_tokens" not in name and name not in ("shared.weight", "lm_head.weight"))


def test_a_tied_head_saved_without_the_embedding_gives_the_embedding_its_weight(tmp_path):
    """A tied model's weights saved as `lm_head.weight` alone (no `shared.weight`): the embedding takes the head's
    weight, as transformers 5 ties to the name that was loaded (transformers 4.57's T5 leaves both on the meta
    device); nothing is missing."""
    model = build(FAT5ForConditionalGeneration, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    weights_file_without(tmp_path, "shared.weight", **{"lm_head.weight": model.shared.weight.detach().clone()})
    loaded, info = FAT5ForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not on_meta(loaded)
    assert torch.equal(loaded.shared.weight, model.shared.weight)
    assert loaded.lm_head.weight is loaded.shared.weight is loaded.encoder.embed_tokens.weight
    assert torch.equal(first_tensor(run(loaded.eval())), first_tensor(run(model)))


def test_an_embedding_of_another_size_reloads_only_with_ignore_mismatched_sizes_as_in_t5(tmp_path):
    """A mis-shaped embedding is refused, or with `ignore_mismatched_sizes` reported and initialised (never left
    on the meta device), as T5's (tied: transformers 5's T5 ties whatever its config says)."""
    mismatched = {}
    for model_class in (FAT5ForConditionalGeneration, T5ForConditionalGeneration):
        folder = tmp_path / model_class.__name__
        build(model_class, tie_word_embeddings=True).save_pretrained(folder)
        with pytest.raises((RuntimeError, ValueError), match="size"):
            model_class.from_pretrained(folder, vocab_size=VOCAB + 3)
        loaded, info = model_class.from_pretrained(folder, vocab_size=VOCAB + 3, ignore_mismatched_sizes=True,
                                                   output_loading_info=True)
        mismatched[model_class] = sorted(entry if isinstance(entry, str) else entry[0]
                                         for entry in info["mismatched_keys"])
        assert loaded.shared.weight.shape[0] == VOCAB + 3 and not on_meta(loaded)
        assert loaded.encoder.embed_tokens.weight is loaded.shared.weight
    assert mismatched[FAT5ForConditionalGeneration] == mismatched[T5ForConditionalGeneration]
    assert "shared.weight" in mismatched[FAT5ForConditionalGeneration]


def test_a_head_of_another_size_reloads_only_with_ignore_mismatched_sizes_as_in_t5(tmp_path):
    mismatched = {}
    for model_class in (fat5.FAT5ForTokenClassification, T5ForTokenClassification):
        folder = tmp_path / model_class.__name__
        model = build(model_class)
        model.save_pretrained(folder)
        with pytest.raises((RuntimeError, ValueError), match="size"):
            model_class.from_pretrained(folder, num_labels=5)
        loaded, info = model_class.from_pretrained(folder, num_labels=5, ignore_mismatched_sizes=True,
                                                   output_loading_info=True)
        # transformers 5 lists (key, saved shape, model shape), 4.57 the keys alone.
        mismatched[model_class] = sorted(entry if isinstance(entry, str) else entry[0]
                                         for entry in info["mismatched_keys"])
        assert loaded.classifier.out_features == 5
        assert torch.equal(loaded.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert mismatched[fat5.FAT5ForTokenClassification] == mismatched[T5ForTokenClassification] == [
        "classifier.bias", "classifier.weight"]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("resize", [dict(new_num_tokens=VOCAB + 7), dict(new_num_tokens=VOCAB - 5),
                                    dict(new_num_tokens=VOCAB + 1, pad_to_multiple_of=16)],
                         ids=["grow", "shrink", "pad-to-multiple"])
def test_resizing_token_embeddings_does_what_it_does_to_t5(tied, resize):
    def resized(model_class):
        model = build(model_class, tie_word_embeddings=tied)
        before = model.get_input_embeddings().weight.detach().clone()
        model.resize_token_embeddings(**resize)
        embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
        kept = min(VOCAB, embeddings.num_embeddings)
        assert torch.equal(embeddings.weight[:kept], before[:kept])
        for stack in (model.encoder, model.decoder):
            assert stack.embed_tokens is embeddings
        inputs = {name: tensor % embeddings.num_embeddings if name.endswith("input_ids") else tensor
                  for name, tensor in inputs_for(model_class).items()}
        inputs["input_ids"][0, 0] = embeddings.num_embeddings - 1
        with torch.no_grad():
            logits = model(**inputs).logits
        return {"vocab_size": model.config.vocab_size, "embeddings": tuple(embeddings.weight.shape),
                "head": tuple(head.weight.shape), "head_is_embedding": head.weight is embeddings.weight,
                "logits": tuple(logits.shape)}

    ours, t5s = resized(FAT5ForConditionalGeneration), resized(T5ForConditionalGeneration)
    # transformers 5's T5Config ties whatever it is given, so T5 cannot be the spec of an untied head.
    assert ours.pop("head_is_embedding") == tied
    t5s.pop("head_is_embedding")
    assert ours == t5s


@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_new_input_embeddings_reach_every_stack(model_class):
    model = build(model_class)
    replacement = torch.nn.Embedding(VOCAB, SHAPES["d_model"])
    model.set_input_embeddings(replacement)
    assert model.get_input_embeddings() is replacement
    stacks = (model.encoder, model.decoder) if model_class in ENCODER_DECODER else (model.encoder,)
    assert all(stack.get_input_embeddings() is replacement for stack in stacks)


# -- training --------------------------------------------------------------------------------------------------------


def gradients(model, inputs):
    model.zero_grad()
    loss_of(model(**inputs)).backward()
    return {name: parameter.grad for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_a_training_step_reaches_every_parameter_and_checkpointing_changes_no_gradient(model_class):
    model = build(model_class).train()
    inputs = labelled_inputs(type(model))
    plain = gradients(model, inputs)
    # (A QA head's biases get zero gradient in exact arithmetic: softmax gradients sum to zero over positions.)
    assert all(grad is not None for grad in plain.values())
    assert all(grad.abs().sum() > 0 for name, grad in plain.items() if name.endswith("weight"))
    largest = max(grad.abs().max() for grad in plain.values())
    settings = [lambda: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True}),
                lambda: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})]
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's, which can skip layers
        settings.append(lambda: model.activation_checkpointing_enable(every_n_layers=2))
    for enable in settings:
        enable()
        assert model.is_gradient_checkpointing
        checkpointed = gradients(model, inputs)
        # Equal up to 1e-5 of the largest gradient entry of the model (the same sums, recomputed).
        assert all(torch.allclose(checkpointed[name], grad, rtol=0, atol=1e-5 * largest)
                   for name, grad in plain.items())
        model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing


TRAINED_HEADS = [FAT5ForConditionalGeneration, fat5.FAT5ForTokenClassification, fat5.FAT5ForSequenceClassification,
                 fat5.FAT5ForQuestionAnswering]


@pytest.mark.parametrize("model_class", TRAINED_HEADS, **by_name)
def test_gradient_accumulation_in_the_trainer_gives_the_step_of_the_whole_batch(model_class, tmp_path, monkeypatch):
    """One SGD step over 4 examples, taken at once or accumulated over 2 micro-batches, moves every weight alike.
    The token head's examples hold 6, 4, 2 and 1 labelled tokens, so every split into two micro-batches is ragged
    and only a loss that weighs every token alike passes."""
    # transformers 4.57's TrainingArguments(bf16=True) of an earlier test leaves ACCELERATE_MIXED_PRECISION=bf16 in
    # this process's environment, which every later Trainer obeys.
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    inputs = labelled_inputs(model_class)
    examples = [{name: tensor[row] for name, tensor in inputs.items()} for row in (0, 1, 0, 1)]
    if model_class is fat5.FAT5ForTokenClassification:
        for example, labelled in zip(examples, (6, 4, 2, 1)):
            example["labels"] = example["labels"].clone()
            example["labels"][labelled:] = -100

    def update(batch_size, accumulation):
        model = build(model_class).train()
        before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
        arguments = TrainingArguments(
            output_dir=str(tmp_path / f"{batch_size}x{accumulation}"), per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation, max_steps=1, optim="sgd", learning_rate=1.0,
            lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, report_to="none",
            save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
        Trainer(model=model, args=arguments, train_dataset=examples).train()
        return {name: parameter.detach() - before[name] for name, parameter in model.named_parameters()}

    whole, accumulated = update(4, 1), update(2, 2)
    largest = max(step.abs().max() for step in whole.values())
    assert largest > 0
    # Equal up to 1e-5 of the largest weight update (the same gradient, summed in another order).
    assert all(torch.allclose(accumulated[name], step, rtol=0, atol=1e-5 * largest) for name, step in whole.items())


@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_a_frozen_model_with_input_gradients_trains_an_adapter_through_checkpointing(model_class):
    """What PEFT does: freeze the model, `enable_input_require_grads`, checkpoint, and still get gradients for
    trainable weights inside the blocks."""
    model = build(model_class).train()
    model.requires_grad_(False)
    adapter = model.encoder.block[0].layer[0].SelfAttention.q.weight
    adapter.requires_grad_(True)
    model.enable_input_require_grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    loss_of(model(**labelled_inputs(type(model)))).backward()
    assert adapter.grad is not None and adapter.grad.abs().sum() > 0


# -- generation ----------------------------------------------------------------------------------------------------


# transformers 5.23's T5 cannot generate when its decoder is deeper than its encoder (FAT5 can; see
# test_generation_cache.py), so generation compared with T5 uses equal depths.
EQUAL_DEPTHS = {"num_decoder_layers": SHAPES["num_layers"]}


def deprecation_warnings(call):
    """(what `call` returns, the FutureWarnings it raised about `past_key_values`)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(warning.message) for warning in caught
                    if issubclass(warning.category, FutureWarning) and "`past_key_values` is deprecated" in
                    str(warning.message)]


@pytest.mark.parametrize("model_class", [fat5.FAT5Model, FAT5ForConditionalGeneration], **by_name)
def test_the_cache_passed_as_past_key_values_warns_where_t5s_forward_warns(model_class):
    """transformers' `test_bc_cache_name_forward` (5.24): the cache passed under its old name, `past_key_values`,
    gives the cache it gives as `cache`, with a FutureWarning exactly where the installed T5's forward gives one
    (transformers 5.24 renamed it; 5.40 removes the old name)."""
    empty = EncoderDecoderCache(DynamicCache(), DynamicCache())
    inputs = {**inputs_for(model_class), "use_cache": True}
    warned, outputs = {}, {}
    for built_class in (T5_OF[model_class], model_class):
        model = build(built_class)
        outputs[built_class], warned[built_class] = deprecation_warnings(
            functools.partial(model, **inputs, past_key_values=copy.deepcopy(empty)))
        assert output_cache(outputs[built_class]).get_seq_length() == inputs["decoder_input_ids"].shape[1]
    assert bool(warned[model_class]) == bool(warned[T5_OF[model_class]])
    assert all(f"`{model_class.__name__}.forward`" in message for message in warned[model_class])
    old = outputs[model_class]
    new, none = deprecation_warnings(lambda: model(**inputs, cache=copy.deepcopy(empty)))
    assert not none and output_cache(new).get_seq_length() == output_cache(old).get_seq_length()
    assert torch.equal(first_tensor(new), first_tensor(old))


def test_a_cache_passed_under_both_names_is_the_one_named_cache_unless_it_holds_nothing():
    """Both names given: the cache named `cache` is used, as T5's forward uses it, unless it is empty and the other
    holds tokens (transformers 5.24's generate passes its own empty cache as `cache` beside the cache PEFT's prefix
    tuning fills under the old name; T5 drops that one)."""
    model = build(FAT5ForConditionalGeneration)
    inputs = inputs_for(FAT5ForConditionalGeneration)
    decoder_input_ids = inputs.pop("decoder_input_ids")
    with torch.no_grad():
        whole = model(**inputs, decoder_input_ids=decoder_input_ids).logits

        def past(length):
            return output_cache(model(**inputs, decoder_input_ids=decoder_input_ids[:, :length], use_cache=True))

        def next_logits(**caches):
            return deprecation_warnings(lambda: model(**inputs, decoder_input_ids=decoder_input_ids[:, 2:3],
                                                      **caches).logits)[0]

        assert close(next_logits(cache=past(2), past_key_values=past(1)), whole[:, 2:3])
        assert close(next_logits(cache=EncoderDecoderCache(DynamicCache(), DynamicCache()),
                                 past_key_values=past(2)), whole[:, 2:3])


def test_generation_continues_from_a_returned_cache_with_the_tokens_of_one_call():
    model = build(FAT5ForConditionalGeneration)
    inputs = generate_inputs()
    arguments = {"do_sample": False, "return_dict_in_generate": True}
    whole = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, **arguments)
    first = model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, **arguments)
    continued = model.generate(**inputs, decoder_input_ids=first.sequences, **cache_field(output_cache(first)),
                               max_new_tokens=3, min_new_tokens=3, **arguments)
    assert torch.equal(continued.sequences, whole.sequences)


@pytest.mark.parametrize("model_class", [FAT5ForConditionalGeneration, T5ForConditionalGeneration], **by_name)
def test_generation_without_inputs_or_pad_token_starts_from_the_decoder_start_token(model_class):
    """T5 configs may leave pad_token_id null; generate then needs no inputs at all."""
    model = build(model_class, pad_token_id=None, bos_token_id=0, **EQUAL_DEPTHS)
    tokens = model.generate(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert tokens.shape == (1, 4) and tokens[0, 0] == model.config.decoder_start_token_id


def test_training_from_labels_without_a_pad_token_says_what_is_missing():
    model = build(FAT5ForConditionalGeneration, pad_token_id=None)
    with pytest.raises(ValueError, match="^FAT5Config.pad_token_id is null"):
        model(**labelled_inputs(type(model)))


def test_prompt_lookup_and_beam_sampling_generate_as_in_t5():
    model = build(FAT5ForConditionalGeneration)
    inputs = generate_inputs()
    arguments = {"max_new_tokens": 4, "min_new_tokens": 4}
    first = {name: tensor[:1] for name, tensor in inputs.items()}  # candidate generators take one row
    greedy = model.generate(**first, do_sample=False, **arguments)
    looked_up = model.generate(**first, do_sample=False, prompt_lookup_num_tokens=2, **arguments)
    assert torch.equal(looked_up, greedy)
    sampled = {}
    for model_class in (FAT5ForConditionalGeneration, T5ForConditionalGeneration):
        torch.manual_seed(0)
        sampled[model_class] = build(model_class, **EQUAL_DEPTHS).generate(**inputs, do_sample=True, num_beams=2,
                                                           num_return_sequences=2, **arguments).shape
    assert sampled[FAT5ForConditionalGeneration] == sampled[T5ForConditionalGeneration] == (4, 5)


# -- forward arguments ------------------------------------------------------------------------------------------------

HEAD_MASKS = {"head_mask", "decoder_head_mask", "cross_attn_head_mask"}  # transformers 4.57's T5 only; FAT5 has none


def outcome(call, model):
    """"accepted", or the error a call raised with the class name left out (so FAT5's and T5's compare)."""
    try:
        call()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0].replace(type(model).__name__, 'MODEL')}"
    return "accepted"


@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_an_unknown_forward_keyword_is_treated_as_t5_treats_it(model_class):
    """transformers 4.57's T5 raises TypeError for a keyword its forward does not take (a misspelt `label=`),
    transformers 5's ignores it: FAT5 does what the installed release's T5 does."""
    results = []
    for cls in (model_class, T5_OF[model_class]):
        model = build(cls)
        results.append(outcome(lambda: model(**inputs_for(cls), label=torch.tensor([0, 1])), model))  # noqa: B023
    assert results[0] == results[1]
    assert results[0] == ("accepted" if TRANSFORMERS_5 else
                          "TypeError: MODEL.forward() got an unexpected keyword argument 'label'")


@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_every_argument_t5s_forward_takes_is_taken(model_class):
    """What transformers passes a T5 forward (generate's `cache_position`, the cache under either name, ...) is
    taken by FAT5's on every release, head masks aside; introspection sees **kwargs exactly where T5 has them."""
    t5_class = T5_OF[model_class]
    t5_parameters = inspect.signature(t5_class.forward).parameters
    names = {name for name, parameter in t5_parameters.items()
             if parameter.kind is not inspect.Parameter.VAR_KEYWORD and name != "self"} - HEAD_MASKS
    names -= set(inputs_for(t5_class)) | {"return_dict"}
    model = build(model_class)
    with torch.no_grad():
        model(**inputs_for(model_class), **{name: None for name in names}, return_dict=True)
    takes_any = [any(parameter.kind is inspect.Parameter.VAR_KEYWORD
                     for parameter in inspect.signature(cls.forward).parameters.values())
                 for cls in (model_class, t5_class)]
    assert takes_any[0] == takes_any[1]


def test_trainer_passes_the_loss_its_token_count_on_every_release():
    from transformers import Trainer, TrainingArguments

    for model_class, expected in ((FAT5ForConditionalGeneration, True), (fat5.FAT5ForTokenClassification, True),
                                  (fat5.FAT5ForSequenceClassification, False), (fat5.FAT5ForQuestionAnswering, False)):
        arguments = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
        assert Trainer(model=build(model_class), args=arguments).model_accepts_loss_kwargs == expected


def test_generate_treats_an_unknown_keyword_as_t5s_generate():
    results = []
    for cls in (FAT5ForConditionalGeneration, T5ForConditionalGeneration):
        model = build(cls)
        results.append(outcome(lambda: model.generate(**generate_inputs(), max_new_tokens=2, label=1), model))  # noqa: B023
    assert results[0] == results[1]


@pytest.mark.parametrize("model_class", FAT5_CLASSES, **by_name)
def test_dummy_inputs_run_a_forward(model_class):
    """`model(**model.dummy_inputs)`, as transformers' tools use it; the encoder-decoders' dummy batch has T5's
    fields (T5's encoder-only classes add decoder inputs their forward refuses on transformers 4.57)."""
    model = build(model_class)
    with torch.no_grad():
        first_tensor(model(**model.dummy_inputs))
    if model_class in ENCODER_DECODER:
        assert set(model.dummy_inputs) == set(build(T5_OF[model_class]).dummy_inputs)
