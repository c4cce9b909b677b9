"""EAGLE-3.1: EAGLE-3 with one RMSNorm per aux state before fc (fc_norm) and the final norm's
output passed to the next draft step (norm_output), the keys vLLM 0.32's llama_eagle3.py reads
(eagle3.model.eagle)."""

from eagle3.model.eagle import EagleFamily

FAMILY = EagleFamily("eagle3.1", fc_norm=True, norm_output=True)
