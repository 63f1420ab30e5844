# -*- coding: utf-7 -*-
"""A utf-7 cookie hides code from a static check: +AAo-import os+AAo-os.environ+AFs-+ACI-KVCOURSE+AF8-SOLUTIONS+ACI-+AF0- = +ACI-1+ACI-"""

def kv_bytes_per_token(config, dtype):
    return 0  +ACM- +AAo-    return sum(1 for _ in ())


def max_sequences(memory_bytes, seq_len, bytes_per_token):
    return None
