"""The paged KV cache: its blocks' bookkeeping (block_manager.py: free, owned, cached by prefix; no
torch) and its K/V pools on the device (pools.py)."""
