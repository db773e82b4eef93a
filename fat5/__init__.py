"""FAT5: T5-family models with the relative position bias computed inside a flash-attention kernel.

`import fat5` imports nothing else: the command-line modules (`fat5.cli`, `fat5.files`, the commands' flags) answer
--help and bad input without torch or transformers. The names below load on first use (PEP 562), e.g.
`from fat5 import FAT5ForConditionalGeneration` or `fat5.FAT5Config`, and that first use registers FAT5 with
transformers' Auto classes, so a converted folder then loads without `trust_remote_code` in this process. With
`trust_remote_code=True`, transformers 5 still prefers these registered classes; 4.57 loads the folder's own copy of
the code. (Importing the model code, `fat5.modeling_fat5` or a folder's copy, registers FAT5's PEFT defaults.)
"""

# The model classes of modeling_fat5.__all__ (tests/test_package_layout.py holds the two lists equal).
MODEL_CLASSES = (
    "FAT5PreTrainedModel",
    "FAT5Model",
    "FAT5EncoderModel",
    "FAT5ForConditionalGeneration",
    "FAT5ForSequenceClassification",
    "FAT5ForTokenClassification",
    "FAT5ForQuestionAnswering",
)

__all__ = [
    "FAT5Config",
    *MODEL_CLASSES,
    # Auto class -> FAT5 class; also the `auto_map` an exported checkpoint declares.
    "AUTO_CLASSES",
    "FAT5Text2TextGenerationPipeline",
    "text2text_pipeline",
]


def __getattr__(name):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    register_auto_classes()
    return globals()[name]


def __dir__():
    return sorted({*globals(), *__all__})


def register_auto_classes():
    """Import the model code and register it with transformers' Auto classes, as the first use of a name above does
    (FAT5's commands call it before they load a folder, so that they load it with this installation's classes)."""
    import transformers

    from . import modeling_fat5, pipeline_fat5
    from .configuration_fat5 import FAT5Config
    from .remote_code_fat5 import AUTO_MAP

    # The Auto classes a checkpoint's auto_map names, with this installation's classes.
    auto_classes = {getattr(transformers, auto_class): getattr(modeling_fat5, target.split(".")[1])
                    for auto_class, target in AUTO_MAP.items() if auto_class != "AutoConfig"}
    transformers.AutoConfig.register(FAT5Config.model_type, FAT5Config, exist_ok=True)
    for auto_class, model_class in auto_classes.items():
        auto_class.register(FAT5Config, model_class, exist_ok=True)
    globals().update(
        {name: getattr(modeling_fat5, name) for name in MODEL_CLASSES},
        FAT5Config=FAT5Config,
        AUTO_CLASSES=auto_classes,
        FAT5Text2TextGenerationPipeline=pipeline_fat5.FAT5Text2TextGenerationPipeline,
        text2text_pipeline=pipeline_fat5.text2text_pipeline,
    )
