"""Data for every trainer: loading and mixing local sources, rendering prompts/responses, tokenized datasets.

load_blended_dataset / require_columns   loading.py     files and save_to_disk folders -> datasets.Dataset
render_prompt / render_response          templates.py   record -> the text the model sees
SFTDataset, collate_padded/_packed       sft.py         SFT samples with a response loss mask
PreferenceDataset, collate_pairs         preference.py  chosen/rejected pairs for RM and DPO
PromptDataset                            prompts.py     prompts (+ labels) for RL
"""

from openppo.datasets.loading import load_blended_dataset, require_columns
from openppo.datasets.preference import PreferenceDataset, collate_pairs
from openppo.datasets.prompts import PromptDataset
from openppo.datasets.sft import SFTDataset, collate_packed, collate_padded
from openppo.datasets.templates import render_prompt, render_response

__all__ = [
    "PreferenceDataset",
    "PromptDataset",
    "SFTDataset",
    "collate_packed",
    "collate_padded",
    "collate_pairs",
    "load_blended_dataset",
    "render_prompt",
    "render_response",
    "require_columns",
]
