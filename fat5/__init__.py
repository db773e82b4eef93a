"""FAT5: T5-family models with the relative position bias computed inside a flash-attention kernel.

Importing this package registers FAT5 with transformers' Auto classes, so a converted folder loads without
`trust_remote_code` in a process that has FAT5 installed. With `trust_remote_code=True`, transformers 5 still
prefers these registered classes; 4.57 loads the folder's own copy of the code.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTextEncoding,
    AutoModelForTokenClassification,
)

from . import modeling_fat5
from .configuration_fat5 import FAT5Config
from .modeling_fat5 import (
    FAT5EncoderModel,
    FAT5ForConditionalGeneration,
    FAT5ForQuestionAnswering,
    FAT5ForSequenceClassification,
    FAT5ForTokenClassification,
    FAT5Model,
    FAT5PreTrainedModel,
)
from .pipeline_fat5 import FAT5Text2TextGenerationPipeline, text2text_pipeline

# Auto class -> FAT5 class; also the `auto_map` an exported checkpoint declares.
AUTO_CLASSES = {
    AutoModel: FAT5Model,
    AutoModelForSeq2SeqLM: FAT5ForConditionalGeneration,
    AutoModelForSequenceClassification: FAT5ForSequenceClassification,
    AutoModelForTokenClassification: FAT5ForTokenClassification,
    AutoModelForQuestionAnswering: FAT5ForQuestionAnswering,
    AutoModelForTextEncoding: FAT5EncoderModel,
}

AutoConfig.register(FAT5Config.model_type, FAT5Config, exist_ok=True)
for auto_class, model_class in AUTO_CLASSES.items():
    auto_class.register(FAT5Config, model_class, exist_ok=True)

__all__ = [
    "FAT5Config",
    *modeling_fat5.__all__,
    "AUTO_CLASSES",
    "FAT5Text2TextGenerationPipeline",
    "text2text_pipeline",
]
