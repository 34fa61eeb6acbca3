"""kdexp.track"""
