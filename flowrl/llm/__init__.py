"""The LLM adapter.

Token log-probs from Hugging Face causal LMs, the text trainer, the toy arithmetic world, trl interop.
"""
