"""FAT5 in the tables other libraries keep of the models they know.

sentence-transformers, optimum's ONNX exporter and CTranslate2's converter each handle T5 through a table keyed by
its config class or model type, and know nothing of FAT5, which (with position_encoding_type "t5") computes what T5
computes under other class names. Each time a FAT5Config is made (a tool loading a folder's config.json, through the
folder's remote code or the installed package alike), FAT5 is added to the table of every such library the process
has imported; none is imported here. What each entry gives:

- sentence-transformers: its table of encoder-decoders whose encoder it loads alone (T5 -> T5EncoderModel) gets
  FAT5 -> `AutoModelForTextEncoding` (FAT5EncoderModel), so `SentenceTransformer(folder, trust_remote_code=True)`
  embeds with the encoder, as for a T5 folder.
- optimum: model type "fat5" exports with optimum's T5 ONNX config (`optimum-cli export onnx --model FOLDER
  --trust-remote-code`, `ORTModelForSeq2SeqLM.from_pretrained(FOLDER, export=True, trust_remote_code=True)`).
- CTranslate2: FAT5Config converts with CTranslate2's T5 loader (`ct2-transformers-converter --model FOLDER
  --trust_remote_code`).

The two exporters take only models T5's own computation describes (`t5_computation_problem`), and refuse others in
one line. A library whose table has moved is left as it is (it then refuses FAT5 folders, as before), with one
warning.

Exported with the model code, so it names no optional library in an import statement: loading a model by Hub id,
transformers reads every import statement of every shipped file and demands each library it names, even one imported
inside a function (`transformers.dynamic_module_utils.check_imports`). The libraries a registration needs are
already imported when it runs (it runs only for modules in `sys.modules`), and `importlib` fetches them by name.
"""

import importlib
import logging
import sys

logger = logging.getLogger(__name__)

# optimum's tasks for T5, all of which its T5 ONNX config exports.
ONNX_TASKS = ("text2text-generation-with-past", "text2text-generation", "feature-extraction-with-past",
              "feature-extraction")


# exporter -> (what it lacks for other models, what it exports to)
EXPORTERS = {"onnx": ("ONNX config", "ONNX"), "ctranslate2": ("CTranslate2 conversion", "CTranslate2")}


def t5_computation_problem(config, exporter):
    """Why `exporter` ("onnx", "ctranslate2") cannot take a model with this config through T5's description of it
    (None if it can): the relative bias must be T5's, and for CTranslate2, which sets its T5 computation from a
    few numbers, q·k unscaled and the norms' epsilon T5's."""
    lacking, target = EXPORTERS[exporter]
    if config.position_encoding_type != "t5":
        return (f"position_encoding_type {config.position_encoding_type!r} has no {lacking}: only 't5' (T5's "
                f"relative bias) exports to {target}")
    if exporter == "ctranslate2":
        if config.attention_scale != 1.0:
            return f"attention_scale {config.attention_scale} has no {lacking}: T5's is 1.0"
        if config.layer_norm_epsilon != 1e-6:
            return f"layer_norm_epsilon {config.layer_norm_epsilon} has no {lacking}: T5's is 1e-06"
    return None


def refuse_unless_t5(config, exporter):
    problem = t5_computation_problem(config, exporter)
    if problem is not None:
        raise ValueError(problem)


class SentenceTransformersEncoder:
    """What sentence-transformers' table of encoder-only classes names for FAT5: the encoder of a FAT5 folder
    through `AutoModelForTextEncoding` (FAT5EncoderModel, the folder's own code with trust_remote_code), as the
    table's T5 entry names T5EncoderModel."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        from transformers import AutoModelForTextEncoding

        return AutoModelForTextEncoding.from_pretrained(*args, **kwargs)


def register_with_sentence_transformers(module, config_class):
    table = module._ENCODER_ONLY_MODELS
    if not any(entry[0] is config_class for entry in table):
        table.append((config_class, __name__, SentenceTransformersEncoder.__name__))


def register_optimum_onnx_config(module=None, config_class=None):
    """Export model type "fat5" with optimum's T5 ONNX config, refusing a FAT5 model it does not describe."""
    T5OnnxConfig = importlib.import_module("optimum.exporters.onnx.model_configs").T5OnnxConfig
    TasksManager = importlib.import_module("optimum.exporters.tasks").TasksManager

    class FAT5OnnxConfig(T5OnnxConfig):
        def __init__(self, config, *args, **kwargs):
            refuse_unless_t5(config, "onnx")
            super().__init__(config, *args, **kwargs)

    TasksManager.create_register("onnx", overwrite_existing=True)("fat5", *ONNX_TASKS)(FAT5OnnxConfig)


def register_with_ctranslate2(module, config_class):
    """Convert FAT5Config with CTranslate2's T5 loader (its umT5 loader's stacks and vocabulary for a bias table
    per layer), loading the model through AutoModelForSeq2SeqLM, with the decoder-output rescale FAT5's config
    states (CTranslate2's T5 loader infers it from the tying) and T5's attention attribute names."""
    OPTIONAL = importlib.import_module("ctranslate2.specs.model_spec").OPTIONAL

    t5_loader, umt5_loader = module.T5Loader, getattr(module, "UMT5Loader", None)

    def family(config):
        if not config.relative_bias_per_layer:
            return t5_loader
        if umt5_loader is None:
            raise ValueError("this ctranslate2 has no umT5 loader for a bias table per layer: pip install -U "
                             "ctranslate2")
        return umt5_loader

    class FAT5Loader(t5_loader):
        @property
        def architecture_name(self):
            return "AutoModelForSeq2SeqLM"

        def get_model_spec(self, model):
            refuse_unless_t5(model.config, "ctranslate2")
            spec = super().get_model_spec(model)
            spec.decoder.scale_outputs = model.config.d_model**-0.5 if model.config.scale_decoder_outputs else OPTIONAL
            return spec

        def get_vocabulary(self, model, tokenizer):
            return family(model.config).get_vocabulary(self, model, tokenizer)

        def set_stack(self, spec, module, is_decoder=False):
            return family(module.config).set_stack(self, spec, module, is_decoder)

    module.register_loader(config_class.__name__)(FAT5Loader)


# library module (imported by the library itself before it reads a config) -> how FAT5 joins its table
REGISTRATIONS = {
    "sentence_transformers.base.modules.transformer": register_with_sentence_transformers,
    "optimum.exporters.onnx": register_optimum_onnx_config,
    "ctranslate2.converters.transformers": register_with_ctranslate2,
}
_registered = set()


def register_with_imported_libraries(config_class):
    """Add FAT5 (`config_class`: the FAT5Config class being instantiated) to the table of each library of
    REGISTRATIONS this process has imported, once per library and class."""
    for module_name, register in REGISTRATIONS.items():
        module = sys.modules.get(module_name)
        if module is None or (module_name, config_class) in _registered:
            continue
        _registered.add((module_name, config_class))
        try:
            register(module, config_class)
        except Exception as error:  # another release of the library: it keeps handling FAT5 as it did
            logger.warning("FAT5 could not add itself to %s's table of models (%s: %s); it handles FAT5 folders as "
                           "before", module_name.split(".")[0], type(error).__name__, error)
