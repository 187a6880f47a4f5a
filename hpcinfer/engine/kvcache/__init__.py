"""The paged KV cache: its blocks' bookkeeping (block_manager.py: free, owned, cached by prefix; no
torch; windowed_blocks.py: sliding-window layers' blocks, freed behind the window) and its K/V
pools on the device (pools.py)."""
