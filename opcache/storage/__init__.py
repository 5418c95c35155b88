"""Where entries are kept: the local folder (``local.py``), and remotes behind it.

The cache (``cache.py``) decides which tier to ask and when; a storage
back-end only knows bytes, by chip and key.  What an entry is, and how every
read of one is checked, is ``entry.py``'s.
"""
