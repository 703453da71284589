"""Upstream LightRFT's ``lightrft.strategy.utils`` package path (compatibility only).

Its modules re-export our names under upstream's paths; our own code never imports
through them. The table of upstream paths is in the package README ("Porting from
LightRFT").
"""
