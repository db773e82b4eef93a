"""Text-to-text generation pipeline for FAT5 checkpoints.

transformers 5.x removed the built-in `text2text-generation` task, so exported checkpoints register this class under
that name in `config.json` (`custom_pipelines`). It is copied flat into the checkpoint folder and loaded as remote
code, so it imports only transformers, and runs on both the 4.57 and the 5.x `Pipeline` base classes.

Inputs and outputs follow transformers 4.x's `Text2TextGenerationPipeline`: a string gives a list with one dict per
returned sequence; a list of strings gives one dict per input, or one list of dicts per input when several sequences
are returned per input.
"""

from transformers import GenerationConfig, Pipeline

# Same defaults as transformers 4.x's text2text-generation, so this is a drop-in replacement.
PIPELINE_GENERATION_DEFAULTS = {"max_new_tokens": 256, "num_beams": 4}


class FAT5Text2TextGenerationPipeline(Pipeline):
    """Generates text from text with an encoder-decoder model.

    Example:

    ```python
    >>> from transformers import pipeline

    >>> generator = pipeline("text2text-generation", model="path/to/fat5-checkpoint", trust_remote_code=True)
    >>> generator("translate English to German: How old are you?", max_new_tokens=32)
    [{'generated_text': 'Wie alt sind Sie?'}]
    ```

    Call parameters: `prefix` (text put before every input; defaults to the model config's `prefix`), `truncation`,
    `return_text` (default True unless `return_tensors` is set), `return_tensors` (adds `generated_token_ids`),
    `clean_up_tokenization_spaces`, and any `generate()` parameter (`max_new_tokens`, `num_beams`, `do_sample`,
    `num_return_sequences`, `generation_config`, ...). The model's `generation_config.json` wins over the pipeline
    defaults (`max_new_tokens=256`, `num_beams=4`); the call's parameters win over both.
    """

    _pipeline_calls_generate = True
    _load_processor = False
    _load_image_processor = False
    _load_video_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    @property
    def _default_generation_config(self):
        """transformers 4.x's text2text-generation defaults, minus what the model's generation config sets.

        The base classes read this in `__init__`. transformers 4.57 would let these defaults override the model's
        generation config, so the ones the model sets are left out here.
        """
        model_params = self.model.generation_config.to_diff_dict()
        return GenerationConfig(**{k: v for k, v in PIPELINE_GENERATION_DEFAULTS.items() if k not in model_params})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not (self.model.can_generate() and getattr(self.model.config, "is_encoder_decoder", False)):
            raise ValueError(
                f"{type(self).__name__} needs an encoder-decoder model that can generate, "
                f"got {type(self.model).__name__}."
            )

    def _sanitize_parameters(
        self,
        prefix=None,
        truncation=None,
        return_tensors=None,
        return_text=None,
        clean_up_tokenization_spaces=None,
        **generate_kwargs,
    ):
        preprocess_params = {}
        if prefix is not None:
            preprocess_params["prefix"] = prefix
        if truncation is not None:
            preprocess_params["truncation"] = truncation

        postprocess_params = {}
        if return_tensors is not None:
            postprocess_params["return_tensors"] = return_tensors
            # As in transformers 4.x, asking for tensors alone drops the text.
            if return_text is None:
                postprocess_params["return_text"] = not return_tensors
        if return_text is not None:
            postprocess_params["return_text"] = return_text
        if clean_up_tokenization_spaces is not None:
            postprocess_params["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces

        forward_params = generate_kwargs
        if getattr(self, "assistant_model", None) is not None:
            forward_params["assistant_model"] = self.assistant_model
        if getattr(self, "assistant_tokenizer", None) is not None:
            forward_params["tokenizer"] = self.tokenizer
            forward_params["assistant_tokenizer"] = self.assistant_tokenizer
        return preprocess_params, forward_params, postprocess_params

    def __call__(self, inputs, **kwargs):
        """Generates from a string or a list of strings; see the class docstring for parameters and outputs."""
        if isinstance(inputs, (list, tuple)) and not inputs:
            # No inputs, no outputs (the base class would index the first input).
            return []
        result = super().__call__(inputs, **kwargs)
        # The base class returns one list per input; 4.x unwrapped single results for list inputs.
        if (
            isinstance(inputs, list)
            and all(isinstance(text, str) for text in inputs)
            and all(len(records) == 1 for records in result)
        ):
            return [records[0] for records in result]
        return result

    def preprocess(self, inputs, prefix=None, truncation=False):
        if not isinstance(inputs, str):
            raise TypeError(f"Inputs must be strings or lists of strings, got {type(inputs).__name__}.")
        if prefix is None:
            prefix = self.prefix or ""
        encoded = self.tokenizer(prefix + inputs, truncation=truncation, return_tensors="pt")
        # Some tokenizers return token_type_ids, which generate() rejects.
        encoded.pop("token_type_ids", None)
        return encoded

    def _forward(self, model_inputs, **generate_kwargs):
        if hasattr(self, "_prepare_generate_kwargs"):
            # transformers 5.x: merges init and call parameters over the model's and the pipeline's defaults.
            generate_kwargs = self._prepare_generate_kwargs(generate_kwargs)
        elif "generation_config" not in generate_kwargs:
            # transformers 4.x: the base class merged those into self.generation_config at init.
            generate_kwargs["generation_config"] = self.generation_config
        in_batch = model_inputs["input_ids"].shape[0]
        output_ids = self.model.generate(**model_inputs, **generate_kwargs)
        # (batch * num_return_sequences, length) -> (batch, num_return_sequences, length)
        output_ids = output_ids.reshape(in_batch, output_ids.shape[0] // in_batch, *output_ids.shape[1:])
        return {"output_ids": output_ids}

    def postprocess(self, model_outputs, return_text=True, return_tensors=False, clean_up_tokenization_spaces=False):
        if not (return_text or return_tensors):
            raise ValueError("Set return_text or return_tensors, otherwise there is nothing to return.")
        records = []
        # The base class hands over one input at a time, with a batch dimension of 1.
        for output_ids in model_outputs["output_ids"][0]:
            record = {}
            if return_text:
                record["generated_text"] = self.tokenizer.decode(
                    output_ids,
                    skip_special_tokens=True,
                    clean_up_tokenization_spaces=clean_up_tokenization_spaces,
                )
            if return_tensors:
                record["generated_token_ids"] = output_ids
            records.append(record)
        return records


def text2text_pipeline(model, tokenizer, **kwargs):
    """The text2text-generation pipeline of an in-memory FAT5 model (e.g. right after fine-tuning), on
    transformers 4.57 and 5.x: `pipeline("text2text-generation", model=model_object)` cannot find a custom
    pipeline without a folder (and transformers 5 removed the built-in task). `kwargs` go to the pipeline
    (`device`, `batch_size`, generation defaults such as `max_new_tokens`, ...)."""
    return FAT5Text2TextGenerationPipeline(model=model, tokenizer=tokenizer, task="text2text-generation", **kwargs)
