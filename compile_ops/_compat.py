"""Where the supported torch releases differ: one place, each difference stated once."""

from __future__ import annotations

import torch
from torch._library.custom_ops import CustomOpDef
from torch.utils._sympy.functions import Identity

# torch < 2.13: the ADInplaceOrView kernel that torch.library.custom_op registers for a
# mutating op reads each mutated argument as ``args[i]``, but the dispatcher hands it the
# call without trailing arguments left at their default, so omitting an optional mutated
# argument (``sparse_mla_out``'s ``workspace``) raised IndexError there.
_FILLS_DEFAULTS = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def omittable_mutated_args(op: CustomOpDef) -> CustomOpDef:
    """Make ``op``'s optional mutated arguments omittable on every supported torch: on
    releases whose ADInplaceOrView kernel indexes them positionally, register one that
    bumps the version of each mutated argument the call passed, then redispatches."""
    if _FILLS_DEFAULTS:
        return op
    overload = op._opoverload
    mutated = [i for i, arg in enumerate(overload._schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write]
    after = torch._C._after_ADInplaceOrView_keyset

    def ad_inplace_or_view(keyset, *args, **kwargs):
        for i in mutated:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                torch.autograd.graph.increment_version(args[i])
        return overload.redispatch(keyset & after, *args, **kwargs)

    op._lib.impl(op._name, ad_inplace_or_view, "ADInplaceOrView", with_keyset=True, allow_override=True)
    return op


# Every supported torch: Inductor's ``Identity`` (a sympy function that keeps an index term
# from being expanded; its ``cat`` lowering wraps each input's offset index in one) stays
# a function of a number when Inductor's tiling analysis substitutes a number for the index
# variable, so ``Max(0, Identity(x) - 1)`` becomes ``Max(0, -1 + Identity(0))``, which sympy
# cannot compare, and the compile fails with "The argument '-1 + ((0))' is not comparable"
# (``sizevars._stride_vars``); whether a compile checks such a fusion varied from run to
# run of the same layer. Here ``Identity`` of a number is that number.
# (pytorch/pytorch#172707 made ``Identity(0)`` comparable, not a sum holding it.)
def _identity_of_a_number(cls, arg):
    return arg if arg.is_Number else None


if "eval" not in vars(Identity):
    Identity.eval = classmethod(_identity_of_a_number)
