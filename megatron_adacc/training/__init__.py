"""The training side: Megatron-LM's arguments, data, and the loop behind pretrain_gpt.py."""
