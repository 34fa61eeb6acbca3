"""kdexp.models"""
