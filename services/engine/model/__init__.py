"""The engine's model: checkpoint loading, tokenizer and Strata's own torch forward passes."""
