"""kdexp.launchers"""
