from dflash2.policy.lru import LRUPolicy
from dflash2.policy.base import register
@register
class HeatPolicy(LRUPolicy):
    name = "heat"
