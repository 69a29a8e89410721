"""How much of a token list a cache holding another can keep."""


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share at the start. A binary search over slice
    comparisons (run in C): prompts run to thousands of tokens, and each step compares them."""
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; the answer is at most high
    if a[:high] == b[:high]:
        return high
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
